"""What clients of other servers send to the OpenAI routes: no `model` (or null, or an
alias), token ids and llama.cpp's objects as embedding inputs, JSON bodies sent as form
data (curl -d), CORS preflights; and what they read back (system_fingerprint, timings,
the embedding model in /v1/models)."""

import json

import openai
import pytest

from deployments.config import AppConfig
from deployments.embeddings import Embedder
from tests.local_app import MODEL, http_client, local_app, run

EMBEDDER = "all-MiniLM-L6-v2"
ALIAS = "gpt-4o-mini"


@pytest.fixture(scope="module")
def wide_app(smollm2_engine, tmp_path_factory):
    db = tmp_path_factory.mktemp("db") / "assistants.sqlite3"
    config = AppConfig.model_validate(
        {
            "assistants": {"database_path": str(db)},
            "cors_origins": ["*"],
            "models": [{"name": MODEL, "aliases": [ALIAS]}],
        }
    )
    embedder = Embedder(config.embeddings)
    with local_app(config, smollm2_engine, embedder) as (app, _):
        yield app, embedder


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def test_model_may_be_left_out_null_an_alias_or_any_name(wide_app):
    """With one model served, any `model` means it (as llama.cpp's server takes it),
    unless strict_model_names or it names a run-time model since stopped; with two, a
    missing one is a 400, an unknown one a 404."""
    app, _ = wide_app
    ingress = app.state.ingress

    async def scenario():
        async with http_client(app) as http:

            async def both(extra: dict) -> tuple:
                chat = await http.post("/v1/chat/completions", json={**CHAT, **extra})
                text = await http.post(
                    "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **extra}
                )
                return chat, text

            answers = {}
            for name, extra in [
                ("missing", {}),
                ("null", {"model": None}),
                ("alias", {"model": ALIAS}),
                ("any", {"model": "gpt-3.5-turbo"}),
            ]:
                answers[name] = await both(extra)
            config = ingress.config
            ingress.config = config.model_copy(update={"strict_model_names": True})
            try:
                answers["strict"] = await both({"model": "gpt-3.5-turbo"})
                answers["strict alias"] = await both({"model": ALIAS})
            finally:
                ingress.config = config
            ingress.runtime_models["other"] = config.models[0].model_copy(update={"name": "other"})
            try:
                answers["two, missing"] = await both({})
                answers["two, unknown"] = await both({"model": "gpt-3.5-turbo"})
            finally:
                ingress.remove_model("other")  # stopped: its name is not the one model's now
            try:
                answers["stopped"] = await both({"model": "other"})
            finally:
                ingress.stopped_models.clear()
            return answers

    answers = run(scenario())
    for name in ("missing", "null", "alias", "any", "strict alias"):
        for reply in answers[name]:
            assert reply.status_code == 200, (name, reply.text)
            assert reply.json()["model"] == MODEL
            assert reply.json()["system_fingerprint"].startswith("fp_")
    statuses = (("strict", 404), ("two, missing", 400), ("two, unknown", 404), ("stopped", 404))
    for name, status in statuses:
        for reply in answers[name]:
            assert reply.status_code == status, (name, reply.text)
            assert reply.json()["error"]["param"] == "model"
    fingerprints = {r.json()["system_fingerprint"] for r in answers["missing"]}
    assert len(fingerprints) == 1


def test_models_list_names_the_embedding_model(wide_app):
    app, _ = wide_app

    async def scenario():
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http
            )
            listed = [m.id async for m in client.models.list()]
            bare = (await http.get("/models")).json()
            one = await client.models.retrieve(EMBEDDER)
            return listed, bare, one

    listed, bare, one = run(scenario())
    assert listed == [MODEL, EMBEDDER]
    assert [m["id"] for m in bare["data"]] == listed
    assert one.id == EMBEDDER
    # llama.cpp's list beside OpenAI's, with what each model does
    assert [(m["name"], m["capabilities"]) for m in bare["models"]] == [
        (MODEL, ["completion"]),
        (EMBEDDER, ["embedding"]),
    ]


def test_embedding_inputs_in_every_form(wide_app):
    """Token ids are the embedding model's own: ids of a text embed as the text does."""
    app, embedder = wide_app
    text = "The sky is blue"
    ids = embedder.tokenizer(text, add_special_tokens=False).input_ids
    half = text.split(" is ")

    async def scenario():
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http
            )

            async def vectors(value):  # noqa: ANN001, ANN202
                reply = await client.embeddings.create(input=value, model=EMBEDDER)
                return [d.embedding for d in reply.data]

            forms = {
                "text": await vectors(text),
                "ids": await vectors(ids),
                "lists": await vectors([ids, text]),
            }
            raw = {}
            for name, value in {
                "mixed": [half[0], *embedder.tokenizer(" is").input_ids[1:-1], " " + half[1]],
                "objects": [{"prompt_string": text}, {"content": [{"type": "text", "text": text}]}],
            }.items():
                reply = await http.post("/v1/embeddings", json={"input": value})
                raw[name] = [d["embedding"] for d in reply.json()["data"]]
            refused = {}
            for name, value in {
                "too long": "word " * 600,
                "empty": "",
                "no inputs": [],
                "image": {"content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                "bad id": [10**9],
            }.items():
                refused[name] = await http.post("/v1/embeddings", json={"input": value})
            ollama = await http.post("/api/embed", json={"model": EMBEDDER, "input": "word " * 600})
            strict = await http.post(
                "/api/embed", json={"model": EMBEDDER, "input": "word " * 600, "truncate": False}
            )
            return forms, raw, refused, ollama, strict

    forms, raw, refused, ollama, strict = run(scenario())
    close = pytest.approx(forms["text"][0], abs=1e-5)
    assert forms["ids"][0] == close
    assert len(forms["lists"]) == 2 and forms["lists"][0] == close and forms["lists"][1] == close
    assert len(raw["mixed"]) == 1 and raw["mixed"][0] == close
    assert len(raw["objects"]) == 2 and all(v == close for v in raw["objects"])
    for name, reply in refused.items():
        assert reply.status_code == 400, name
        assert reply.json()["error"]["param"] == "input", name
    assert "too large" in refused["too long"].json()["error"]["message"]
    assert ollama.status_code == 200 and len(ollama.json()["embeddings"]) == 1
    assert strict.status_code == 400 and "too large" in strict.json()["error"]


def test_a_json_body_is_read_whatever_its_content_type(wide_app):
    """As `curl -d` sends it (form-urlencoded), and with no type at all; but not when a
    browser sent it from another site's page (such posts need no CORS preflight)."""
    app, _ = wide_app

    async def scenario():
        async with http_client(app) as http:
            replies = []
            for path, body in [
                ("/v1/chat/completions", CHAT),
                ("/api/chat", {"model": MODEL, **CHAT, "stream": False}),
                ("/completion", {"prompt": "Hi", "n_predict": 2}),
                ("/tokenize", {"content": "Hi"}),
            ]:
                for content_type in ("application/x-www-form-urlencoded", "text/plain", None):
                    headers = {} if content_type is None else {"content-type": content_type}
                    replies.append(await http.post(path, content=json.dumps(body), headers=headers))
            forged = []
            for headers in (
                {"origin": "http://elsewhere.example"},
                {"sec-fetch-site": "cross-site"},
            ):
                headers["content-type"] = "text/plain"
                forged.append(
                    await http.post("/completion", content=json.dumps({}), headers=headers)
                )
            infill = await http.post("/infill", json={"prompt": {"prompt_string": "x"}})
            return replies, forged, infill

    replies, forged, infill = run(scenario())
    for reply in replies:
        assert reply.status_code == 200, (reply.request.url, reply.request.headers, reply.text)
    for reply in forged:
        assert reply.status_code == 400 and "error" in reply.json()
    assert infill.status_code == 400  # /infill's prompt is text or ids, never an object


def test_chat_reports_timings_and_cors_preflights_answer(wide_app):
    app, _ = wide_app

    async def scenario():
        async with http_client(app) as http:
            whole = (await http.post("/v1/chat/completions", json=CHAT)).json()
            async with http.stream(
                "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
            ) as response:
                lines = [line async for line in response.aiter_lines()]
            preflight = await http.options(
                "/v1/chat/completions",
                headers={
                    "Origin": "http://localhost:5173",
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "Authorization, Content-Type",
                },
            )
            return whole, lines, preflight

    whole, lines, preflight = run(scenario())
    assert whole["timings"]["predicted_n"] == whole["usage"]["completion_tokens"]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    last = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert last["timings"]["predicted_n"] >= 1 and "timings" not in chunks[0]
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] in ("*", "http://localhost:5173")
    assert "POST" in preflight.headers["access-control-allow-methods"]


def test_llamacpp_extensions_on_chat(wide_app):
    """A prefill continued (vLLM's continue_final_message), llama.cpp's top-level
    grammar and json_schema, a json_object with a schema, and timings in every chunk."""
    app, _ = wide_app
    ask = [{"role": "user", "content": "Name a colour."}]
    prefill = [*ask, {"role": "assistant", "content": "My favourite colour is"}]

    async def scenario():
        async with http_client(app) as http:
            post = http.post
            body = {"messages": prefill, "continue_final_message": True, "max_tokens": 4}
            template = (await post("/apply-template", json=body)).json()["prompt"]
            continued = (await post("/v1/chat/completions", json=body)).json()
            refused = await post("/v1/chat/completions", json={**body, "messages": ask})
            shaped = {}
            for name, extra in [
                ("grammar", {"grammar": 'root ::= "a"{5,5}'}),
                ("json_schema", {"json_schema": {"const": "42"}}),
                ("schema", {"response_format": {"type": "json_object", "schema": {"const": 7}}}),
            ]:
                reply = await post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, **extra})
                shaped[name] = reply.json()["choices"][0]["message"]["content"]
            async with http.stream(
                "POST",
                "/v1/chat/completions",
                json={**CHAT, "max_tokens": 4, "stream": True, "timings_per_token": True},
            ) as response:
                lines = [line async for line in response.aiter_lines()]
            return template, continued, refused, shaped, lines

    template, continued, refused, shaped, lines = run(scenario())
    assert template.endswith("<|im_start|>assistant\nMy favourite colour is")
    assert continued["choices"][0]["message"]["content"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    assert shaped == {"grammar": "aaaaa", "json_schema": '"42"', "schema": "7"}
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "timings" not in chunks[0]  # the role's chunk comes before any token
    assert all("timings" in c for c in chunks[1:] if c["choices"])


def test_llamacpp_chat_fields_progress_slot_and_reasoning(wide_app):
    """llama.cpp's chat fields: return_progress reports the prompt in the role's chunk,
    id_slot is taken in range, an earlier turn's reasoning_content reaches the template,
    add_generation_prompt: false renders no generation prompt, and with
    continue_final_message it is refused (vLLM's rule)."""
    app, _ = wide_app
    answered = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"},
    ]

    async def scenario():
        async with http_client(app) as http:
            post = http.post
            async with http.stream(
                "POST",
                "/v1/chat/completions",
                json={**CHAT, "max_tokens": 2, "stream": True, "return_progress": True},
            ) as response:
                lines = [line async for line in response.aiter_lines()]
            slotted = await post(
                "/v1/chat/completions", json={**CHAT, "max_tokens": 2, "id_slot": 0}
            )
            no_slot = await post("/v1/chat/completions", json={**CHAT, "id_slot": 100_000})
            reasoned = await post(
                "/v1/chat/completions", json={"messages": answered, "max_tokens": 2}
            )
            both = await post(
                "/v1/chat/completions",
                json={
                    "messages": answered[:2],
                    "continue_final_message": True,
                    "add_generation_prompt": True,
                },
            )
            closed = await post("/apply-template", json={**CHAT, "add_generation_prompt": False})
            return lines, slotted, no_slot, reasoned, both, closed.json()["prompt"]

    lines, slotted, no_slot, reasoned, both, closed = run(scenario())
    assert closed.endswith("<|im_end|>\n")  # no generation prompt: the turn as it is
    first = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])
    progress = first["prompt_progress"]
    assert progress["total"] == progress["processed"] > 0 and progress["time_ms"] > 0
    assert slotted.status_code == 200 and reasoned.status_code == 200
    assert no_slot.status_code == 400 and no_slot.json()["error"]["param"] == "id_slot"
    assert both.status_code == 400 and both.json()["error"]["param"] == "add_generation_prompt"
