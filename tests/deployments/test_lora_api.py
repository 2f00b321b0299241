"""LoRA adapters through every dialect, in-process: the config's `engine.loras` are served
as `<base>:<adapter>` and by the adapter's own name, listed in /v1/models with their base;
OpenAI (the official client), Ollama and Anthropic each answer with the adapter the
engine runs alone; a request naming no adapter on the same connection
right after one that did gets the base model; an unknown adapter is a 404."""

import openai
import pytest

from app.engine import EngineConfig, LLMEngine
from app.models.source import resolve_model
from app.protocol.sampling import SamplingParams
from app.text.tokenizer import load_tokenizer
from deployments.config import AppConfig
from tests.helpers import chat_ids
from tests.local_app import MODEL, http_client, local_app, run
from tests.lora_adapters import ATTENTION, MLP, make_adapter

pytest.importorskip("peft")
ASK = [{"role": "user", "content": "Write one line about the sea."}]
TOKENS = 12


@pytest.fixture(scope="module")
def adapter_dir(smollm2_hf, tmp_path_factory):
    settings = dict(r=8, lora_alpha=16, target_modules=ATTENTION + MLP)
    return make_adapter(smollm2_hf, tmp_path_factory.mktemp("lora") / "sea", 5, settings)


@pytest.fixture(scope="module")
def served(smollm2_engine, adapter_dir, tmp_path_factory):
    engine_config = {
        "device": "cpu", "dtype": "float32", "quantization": "none", "num_threads": 2,
        "kv_cache_memory_gib": 0.1, "loras": {"sea": str(adapter_dir)},
    }  # fmt: skip
    engine = LLMEngine(EngineConfig(**engine_config), loaded=smollm2_engine.loaded)
    state = tmp_path_factory.mktemp("state")
    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "assistants": {"database_path": str(state / "assistants.sqlite3")},
            "models": [{"name": MODEL, "engine": engine_config}],
        }
    )
    # The answers the engine gives alone, before the app steps it.
    tokenizer = load_tokenizer(resolve_model("default"))
    prompt = chat_ids(tokenizer, ASK[0]["content"])
    expected = {}
    for lora in (None, "sea"):
        ids = engine.generate([prompt], greedy(lora))[0].outputs[0].token_ids
        expected[lora] = tokenizer.decode(ids, skip_special_tokens=True)
    assert expected[None] != expected["sea"]
    with local_app(config, engine) as (app, _):
        yield app, expected


def greedy(lora: str | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, lora=lora)


def test_every_dialect_runs_the_named_adapter(served):
    app, expected = served

    async def scenario() -> dict:
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http
            )
            got = {}
            for name in (f"{MODEL}:sea", "sea", MODEL):
                reply = await client.chat.completions.create(
                    model=name, messages=ASK, max_tokens=TOKENS, temperature=0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                got[f"openai {name}"] = reply.choices[0].message.content
            ollama = {"model": f"{MODEL}:sea", "messages": ASK, "stream": False}
            options = {"num_predict": TOKENS, "temperature": 0, "repeat_penalty": 1.0}
            r = await http.post("/api/chat", json={**ollama, "options": options})
            got["ollama"] = r.json()["message"]["content"]
            anthropic = {"model": f"{MODEL}:sea", "messages": ASK, "max_tokens": TOKENS}
            r = await http.post("/v1/messages", json={**anthropic, "temperature": 0})
            got["anthropic"] = r.json()["content"][0]["text"]
            # Responses keeps a stored turn's KV in the base's context: this one runs
            # without it, on the adapter
            r = await client.responses.create(
                model=f"{MODEL}:sea", input=ASK, max_output_tokens=TOKENS, temperature=0,
            )  # fmt: skip
            got["responses"] = r.output_text
            models = (await http.get("/v1/models")).json()["data"]
            unknown = await http.post(
                "/v1/chat/completions", json={"model": f"{MODEL}:nobody", "messages": ASK}
            )
            return got, models, unknown

    got, models, unknown = run(scenario())
    for name, text in got.items():
        want = expected[None] if name == f"openai {MODEL}" else expected["sea"]
        assert text.startswith(want[:20]), (name, text, want)
    card = next(m for m in models if m["id"] == f"{MODEL}:sea")
    assert card["parent"] == MODEL
    assert unknown.status_code == 404 and "nobody" in unknown.json()["error"]["message"]
