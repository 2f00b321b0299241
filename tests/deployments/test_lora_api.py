"""LoRA adapters through every dialect, in-process: the config's `engine.loras` are served
as `<base>:<adapter>` and by the adapter's own name, listed in /v1/models with their base;
OpenAI (the official client), Ollama and Anthropic each answer with the adapter the
engine runs alone; a request naming no adapter on the same connection
right after one that did gets the base model; an unknown adapter is a 404."""

import httpx
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
def models_dir(smollm2_hf, tmp_path_factory):
    """The operator's models_dir, with an adapter to load at run time, and a broken one."""
    root = tmp_path_factory.mktemp("models")
    settings = dict(r=4, lora_alpha=8, target_modules=ATTENTION)
    make_adapter(smollm2_hf, root / "adapters" / "gulf", 9, settings)
    (root / "adapters" / "broken").mkdir()
    (root / "adapters" / "broken" / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    return root


@pytest.fixture(scope="module")
def served(smollm2_engine, adapter_dir, models_dir, tmp_path_factory):
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
            "operator": {"models_dir": str(models_dir)},
        }
    )
    # The answers the engine gives alone, before the app steps it.
    tokenizer = load_tokenizer(resolve_model("default"))
    prompt = chat_ids(tokenizer, ASK[0]["content"])
    expected = {}
    engine.set_lora("gulf", str(models_dir / "adapters" / "gulf"))
    for lora in (None, "sea", "gulf"):
        ids = engine.generate([prompt], greedy(lora))[0].outputs[0].token_ids
        expected[lora] = tokenizer.decode(ids, skip_special_tokens=True)
    engine.set_lora("gulf", None)  # loaded through the API in the test
    assert len(set(expected.values())) == 3
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


def test_adapters_load_and_unload_at_run_time_as_vllm_s_routes_do(served, models_dir):
    app, expected = served
    gulf = {"lora_name": "gulf", "lora_path": "adapters/gulf"}  # under models_dir

    async def chat(http, model: str):  # noqa: ANN202
        body = {"model": model, "messages": ASK, "max_tokens": TOKENS, "temperature": 0}
        return await http.post("/v1/chat/completions", json={**body, "ignore_eos": True})

    async def scenario() -> dict:
        got = {}
        async with http_client(app) as http:
            got["before"] = await chat(http, f"{MODEL}:gulf")
            load = await http.post("/v1/load_lora_adapter", json=gulf)
            got["load"] = (load.status_code, load.text)
            got["again"] = await http.post("/v1/load_lora_adapter", json=gulf)
            got["by name"] = await chat(http, "gulf")
            got["by base"] = await chat(http, f"{MODEL}:gulf")
            got["models"] = (await http.get("/v1/models")).json()["data"]
            got["card"] = (await http.get(f"/v1/models/{MODEL}:gulf")).json()
            got["listed"] = (await http.get("/api/lora-adapters")).json()["adapters"]
            for name, path in (("out", str(models_dir.parent)), ("out2", "../"),
                               ("bad", "adapters/broken"), ("none", "adapters/nowhere"),
                               ("a:b", "adapters/gulf"), (MODEL, "adapters/gulf"),
                               ("nul", "adapters/\u0000"), ("long", "x" * 1000)):  # fmt: skip
                r = await http.post(
                    "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
                )
                got[f"refused {name}"] = r
            got["config"] = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sea"})
            unload = await http.post("/v1/unload_lora_adapter", json={"lora_name": "gulf"})
            got["unload"] = (unload.status_code, unload.text)
            got["after"] = await chat(http, f"{MODEL}:gulf")
            got["unload again"] = await http.post(
                "/v1/unload_lora_adapter", json={"lora_name": "gulf"}
            )
        remote = httpx.ASGITransport(app=app, client=("203.0.113.9", 4000))
        async with httpx.AsyncClient(transport=remote, base_url="http://localhost") as http:
            got["remote"] = await http.post("/v1/load_lora_adapter", json=gulf)
        return got

    got = run(scenario())
    assert got["before"].status_code == 404
    assert got["load"] == (200, "Success: LoRA adapter 'gulf' added successfully.")
    assert got["again"].status_code == 400 and "already" in got["again"].json()["error"]["message"]
    for name in ("by name", "by base"):
        text = got[name].json()["choices"][0]["message"]["content"]
        assert text.startswith(expected["gulf"][:20]), (name, text, expected["gulf"])
    card = next(m for m in got["models"] if m["id"] == f"{MODEL}:gulf")
    assert card["parent"] == MODEL and got["card"]["id"] == f"{MODEL}:gulf"
    listed = {a["name"]: a for a in got["listed"]}
    assert listed["gulf"]["source"] == "runtime" and listed["sea"]["source"] == "config"
    for name in ("out", "out2", "bad", "none", "a:b", MODEL, "nul", "long"):
        r = got[f"refused {name}"]
        assert r.status_code == 400 and "error" in r.json(), (name, r.text)
    assert got["config"].status_code == 400
    assert got["unload"] == (200, "Success: LoRA adapter 'gulf' removed successfully.")
    assert got["after"].status_code == 404
    assert got["unload again"].status_code == 404
    assert got["remote"].status_code == 403  # an operator action: not from another machine
