"""LoRA adapters loaded at run time through the live app: vLLM's load route (an operator
action, from this machine), the adapter served by its name in the OpenAI and Ollama
clients through Serve's multiplexed routing to a replica that read it, recorded by the
operator (its database) and listed; unloaded, it runs no more."""

import os
from pathlib import Path

import httpx
import ollama
import pytest

from tests.lora_adapters import ATTENTION, MLP, make_adapter
from tests.serve.conftest import MODEL

pytest.importorskip("peft")
ASK = [{"role": "user", "content": "Write one line about the sea."}]


def test_an_adapter_loaded_at_run_time_is_served_then_unloaded(base_url, client, smollm2_hf):
    root = Path(os.environ["SHOAL_MODELS_DIR"])
    settings = dict(r=8, lora_alpha=32, target_modules=ATTENTION + MLP)
    make_adapter(smollm2_hf, root / "adapters" / "live", 3, settings)
    make_adapter(smollm2_hf, root / "adapters" / "other", 4, settings)

    def chat(model: str) -> str:
        reply = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=12, temperature=0
        )
        return reply.choices[0].message.content

    base = chat(MODEL)
    body = {"lora_name": "live", "lora_path": "adapters/live"}
    loaded = httpx.post(f"{base_url}/v1/load_lora_adapter", json=body, timeout=120)
    assert loaded.status_code == 200, loaded.text
    try:
        tuned = chat("live")
        assert tuned != base and chat(f"{MODEL}:live") == tuned
        reply = ollama.Client(host=base_url, timeout=120).chat(
            model=f"{MODEL}:live",
            messages=ASK,
            options={"temperature": 0, "num_predict": 12, "repeat_penalty": 1.0},
        )
        assert reply.message.content == tuned
        listed = httpx.get(f"{base_url}/api/lora-adapters").json()["adapters"]
        assert {"model": MODEL, "name": "live", "source": "runtime"}.items() <= next(
            a for a in listed if a["name"] == "live"
        ).items()
        ids = [m.id for m in client.models.list().data]
        assert f"{MODEL}:live" in ids
        # Replaced in place by other weights, then by the first again: each load is read
        # anew, though the replica still holds the earlier reads.
        for path, want in (("adapters/other", None), ("adapters/live", tuned)):
            body = {"lora_name": "live", "lora_path": path, "load_inplace": True}
            replaced = httpx.post(f"{base_url}/v1/load_lora_adapter", json=body, timeout=120)
            assert replaced.status_code == 200, replaced.text
            now = chat("live")
            assert now == want if want else now not in (tuned, base)
    finally:
        gone = httpx.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "live"})
    assert gone.status_code == 200, gone.text
    # The base has no adapter left: `base:live` reads as an Ollama tag of the base now.
    assert chat(f"{MODEL}:live") == base
