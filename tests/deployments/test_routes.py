"""Every dialect's routes in-process: the real app, Ingress, Tokenizer and ModelServer
over the real default model's engine, without Ray (see tests/local_app.py)."""

import asyncio
import re

import openai
import pytest

from deployments.config import AppConfig
from tests.local_app import http_client, local_app

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def app(smollm2_engine, tmp_path_factory):
    slots = tmp_path_factory.mktemp("slots")
    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "models": [{"name": MODEL, "slot_save_path": str(slots)}],
        }
    )
    with local_app(config, smollm2_engine) as (app, _):
        yield app


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def _ttft_count(metrics: str) -> float:
    match = re.search(rf'shoal_time_to_first_token_seconds_count{{model="{MODEL}"}} (\S+)', metrics)
    return float(match.group(1)) if match else 0.0


def test_openai_sdk_chat_and_stream(app):
    async def scenario():
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(base_url="http://local/v1", api_key="x", http_client=http)
            messages = [{"role": "user", "content": "Name a colour."}]
            whole = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0
            )
            pieces = []
            async for chunk in await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
            ):
                pieces += [c.delta.content or "" for c in chunk.choices]
            return whole, "".join(pieces)

    whole, streamed = run(scenario())
    assert whole.choices[0].message.content and whole.usage.completion_tokens <= 8
    assert streamed == whole.choices[0].message.content  # greedy: one text either way


def test_completions_prompt_forms(app):
    """Several prompts run together (in float32, as here, greedy output does not depend on
    the batch; in bfloat16 it may)."""

    async def scenario():
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(base_url="http://local/v1", api_key="x", http_client=http)
            create = client.completions.create
            one = await create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)
            prompts = ["The sky is", "Water is", "One two three"]
            many = await create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
            alone = [
                await create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts
            ]
            ids = await create(model=MODEL, prompt=[504, 7042, 314], max_tokens=4, temperature=0)
            echo = await create(
                model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, echo=True
            )
            return one, many, alone, ids, echo

    one, many, alone, ids, echo = run(scenario())
    assert one.choices[0].text and one.usage.prompt_tokens > 0
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == one.choices[0].text
    assert [c.text for c in many.choices] == [a.choices[0].text for a in alone]
    assert many.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert ids.usage.prompt_tokens == 3
    assert echo.choices[0].text.startswith("The sky is")


def test_every_dialect_is_timed_and_counted(app):
    """TTFT is recorded for generations started by every dialect, streamed or not."""

    async def scenario():
        async with http_client(app) as http:
            before = _ttft_count((await http.get("/metrics")).text)
            calls = [
                (
                    "/v1/chat/completions",
                    {
                        "model": MODEL,
                        "max_tokens": 3,
                        "stream": True,
                        "messages": [{"role": "user", "content": "Hi"}],
                    },
                ),
                ("/completion", {"prompt": "Hello", "n_predict": 3}),
                ("/completion", {"prompt": "Hello", "n_predict": 3, "stream": True}),
                (
                    "/api/generate",
                    {
                        "model": MODEL,
                        "prompt": "Hi",
                        "stream": False,
                        "options": {"num_predict": 3},
                    },
                ),
                (
                    "/api/chat",
                    {
                        "model": MODEL,
                        "options": {"num_predict": 3},
                        "messages": [{"role": "user", "content": "Hi"}],
                    },
                ),
                ("/fill", {"session_id": 1, "task_id": 1, "context_id": 91, "text": "The sea"}),
                (
                    "/generate",
                    {
                        "session_id": 1,
                        "task_id": 2,
                        "context_id": 91,
                        "sampling_config": {"max_gen_length": 3},
                    },
                ),
            ]
            for path, body in calls:
                r = await http.post(path, json=body)
                assert r.status_code == 200, (path, r.text)
            after = _ttft_count((await http.get("/metrics")).text)
            return after - before, len(calls)

    counted, sent = run(scenario())
    assert counted == sent


def test_refusals_come_back_in_each_dialects_shape(app):
    async def scenario():
        async with http_client(app) as http:
            openai_400 = await http.post(
                "/v1/completions", json={"model": MODEL, "prompt": "x", "seed": -1}
            )
            openai_404 = await http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            ollama_404 = await http.post("/api/chat", json={"model": "nope", "messages": []})
            parrot_404 = await http.post("/free_context", json={"context_id": 12345})
            return openai_400, openai_404, ollama_404, parrot_404

    openai_400, openai_404, ollama_404, parrot_404 = run(scenario())
    assert openai_400.status_code == 400 and openai_400.json()["error"]["param"] == "seed"
    assert openai_404.status_code == 404
    assert openai_404.json()["error"]["code"] == "model_not_found"
    assert ollama_404.status_code == 404 and isinstance(ollama_404.json()["error"], str)
    assert parrot_404.status_code == 404 and "error" in parrot_404.json()


def test_ollama_generate_reports_its_prompt_and_figures(app, smollm2_tokenizer):
    async def scenario():
        async with http_client(app) as http:
            body = {"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 4}}
            plain = (await http.post("/api/generate", json=body)).json()
            system = "You answer like a pirate."
            with_system = (await http.post("/api/generate", json={**body, "system": system})).json()
            return plain, with_system, system

    plain, with_system, system = run(scenario())
    assert (
        plain["done"] and plain["eval_count"] == len(plain["context"]) - plain["prompt_eval_count"]
    )
    assert plain["total_duration"] >= plain["prompt_eval_duration"] > 0
    assert plain["load_duration"] == 0  # the model is always loaded
    # The system prompt is in the prompt the model read, not just somewhere nearby.
    prompt = with_system["context"][: with_system["prompt_eval_count"]]
    assert system in smollm2_tokenizer.decode(prompt)
    assert system not in smollm2_tokenizer.decode(plain["context"])


def test_llamacpp_slots_cache_save_and_restore(app):
    async def scenario():
        async with http_client(app) as http:
            prompt = "Once upon a time, in a land far away, there lived"
            body = {"prompt": prompt, "n_predict": 4, "id_slot": 0, "temperature": 0}
            first = (await http.post("/completion", json=body)).json()
            longer = prompt + first["content"] + " and"
            again = (await http.post("/completion", json={**body, "prompt": longer})).json()
            slots = (await http.get("/slots")).json()
            saved = (await http.post("/slots/0?action=save", json={"filename": "s0.bin"})).json()
            erased = (await http.post("/slots/0?action=erase")).json()
            restored = (
                await http.post("/slots/0?action=restore", json={"filename": "s0.bin"})
            ).json()
            bad = await http.post("/slots/999?action=erase")
            return first, again, slots, saved, erased, restored, bad

    first, again, slots, saved, erased, restored, bad = run(scenario())
    assert first["tokens_cached"] == 0 and again["tokens_cached"] > 0
    assert {"id", "n_ctx", "is_processing", "state"} <= set(slots[0])
    assert saved["n_saved"] > 0 and saved["n_written"] > 0 and "save_ms" in saved["timings"]
    assert erased["n_erased"] == saved["n_saved"]
    assert restored["n_restored"] == saved["n_saved"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "id_slot"
