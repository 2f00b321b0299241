"""Hostile and careless clients against the live app: every request is bounded, refused
clearly in its dialect's shape, or cleaned up, and nobody else's request is harmed.

Each test names the issue-13 item it pins. Runs before test_replica_recovery (file order),
which takes the secured app's replica down.
"""

import asyncio
import json
import time

import httpx
import openai
import pytest
from ray import serve

from tests.serve.conftest import MODEL

SECURED = "/secured"
KEY = {"Authorization": "Bearer sk-test-1"}
CHAT = [{"role": "user", "content": "Hi"}]


def post(base_url: str, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=120, **kwargs)


def engine(app: str = "default", model: str = MODEL) -> dict:
    handle = serve.get_deployment_handle(f"ModelServer:{model}", app_name=app)
    return handle.stats.remote().result(timeout_s=30)


def wait_idle(app: str = "default", model: str = MODEL, within_s: float = 2.0) -> float:
    """Seconds until the replica runs and queues nothing; fails past `within_s`."""
    started = time.monotonic()
    while True:
        stats = engine(app, model)
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return time.monotonic() - started
        assert time.monotonic() - started < within_s, stats
        time.sleep(0.1)


# ---- 1. one request kills the engine ----------------------------------------------------
@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "n": 2, "seed": 2**64 - 1}, "seed"),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "seed": 2**63}, "seed"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "seed": -1}, "seed"),
        ("/completion", {"prompt": "Hi", "seed": 2**64 - 1}, "seed"),
        (
            "/generate",
            {
                "session_id": 1,
                "task_id": 1,
                "context_id": 77001,
                "sampling_config": {"seed": 2**64},
            },
            "sampling_config.seed",
        ),
    ],
)
def test_out_of_range_seeds_are_refused_and_the_engine_lives(base_url, path, body, param):
    pid = engine()["engine_pid"]
    r = post(base_url, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = post(base_url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and engine()["engine_pid"] == pid


def test_out_of_range_seed_on_ollama(base_url):
    r = post(
        base_url, "/api/generate", {"model": MODEL, "prompt": "Hi", "options": {"seed": 2**64}}
    )
    assert r.status_code == 400 and "seed" in r.json()["error"]


# ---- 2. contexts and slots ----------------------------------------------------------------
def test_completion_with_a_slot_outside_the_slots_is_400(base_url):
    for slot in (128, 10**6, -2):
        r = post(base_url, "/completion", {"prompt": "Hi", "n_predict": 2, "id_slot": slot})
        assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot", r.text


def test_a_busy_context_cannot_be_freed(base_url):
    ids = {"session_id": 9, "task_id": 1, "context_id": 77002}
    assert post(base_url, "/fill", {**ids, "text": "Once upon a time"}).status_code == 200
    body = {**ids, "sampling_config": {"max_gen_length": 400, "ignore_tokenizer_eos": True}}
    with httpx.stream("POST", f"{base_url}/generate_stream", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        busy = post(base_url, "/free_context", {"context_id": 77002})
        assert busy.status_code == 409 and "busy" in busy.json()["error"]["message"]
        for _ in lines:
            pass
    freed = post(base_url, "/free_context", {"context_id": 77002})
    assert freed.status_code == 200 and freed.json()["context_len"] > 400


# ---- 3. cancellation ----------------------------------------------------------------------
def test_dropped_requests_are_aborted_at_every_hop(base_url):
    """100 long streams (half of them asking Serve not to watch for disconnects) and 20
    long non-streamed calls, all dropped by their clients after half a second: the engine
    runs and queues nothing within 2 s."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 2000,
        "ignore_eos": True,
    }

    async def drop(client: httpx.AsyncClient, i: int) -> None:
        headers = {"x-request-disconnect-disabled": "?1"} if i % 2 else {}
        payload = {**body, "stream": i < 100}
        try:
            async with asyncio.timeout(0.5):
                async with client.stream(
                    "POST", f"{base_url}/v1/chat/completions", json=payload, headers=headers
                ) as r:
                    async for _ in r.aiter_bytes():
                        pass
        except (TimeoutError, httpx.HTTPError):
            pass

    async def flood() -> None:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            await asyncio.gather(*(drop(client, i) for i in range(120)))

    asyncio.run(flood())
    wait_idle(within_s=2.0)


def test_a_request_cannot_lift_the_request_timeout(base_url):
    """The secured app allows 8 s; Serve's own timeout can be lifted by a header, ours not."""
    body = {
        "model": "secured-model",
        "messages": [{"role": "user", "content": "Count to ten thousand."}],
        "max_tokens": 4000,
        "ignore_eos": True,
    }
    headers = {**KEY, "x-request-timeout-seconds": "0", "x-request-disconnect-disabled": "?1"}
    started = time.monotonic()
    r = post(base_url, f"{SECURED}/v1/chat/completions", body, headers=headers)
    assert r.status_code == 408, r.text
    assert r.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < 60
    wait_idle("secured", "secured-model", within_s=3.0)


# ---- 4. ingress stalls --------------------------------------------------------------------
def test_ollama_templates_render_linearly_and_take_text_literally(base_url):
    started = time.monotonic()
    r = post(base_url, "/api/generate", {"model": MODEL, "prompt": "x", "template": "{{if" * 8000})
    assert r.status_code == 400 and "template" in r.json()["error"]
    r = post(base_url, "/api/generate", {"model": MODEL, "template": "x" * 70_000, "prompt": "x"})
    assert r.status_code == 400
    # 65 KB of template repeating a 100 KB prompt would render gigabytes: refused at 2 MB.
    body = {"model": MODEL, "template": "{{ .Prompt }}" * 5000, "prompt": "x" * 100_000}
    r = post(base_url, "/api/generate", body)
    assert r.status_code == 400 and "characters" in r.json()["error"]
    assert time.monotonic() - started < 10  # it used to take a second for 32 KB
    prompt = r"C:\Users\me \1 \g<0> {{ .System }}"
    template = "{{ if .System }}[{{ .System }}]{{ end }}<<{{ .Prompt }}>>"
    r = post(
        base_url,
        "/api/generate",
        {"model": MODEL, "prompt": prompt, "template": template, "stream": False}
        | {"options": {"num_predict": 1}},
    )
    assert r.status_code == 200, r.text
    tokens = post(base_url, "/tokenize", {"content": f"<<{prompt}>>"}).json()["tokens"]
    assert r.json()["prompt_eval_count"] == len(tokens)


def test_stop_strings_are_bounded_in_every_dialect(base_url):
    many = [f"stop{i}" for i in range(65)]
    long = ["x" * 1025]
    cases = [
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "stop": many}),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "stop": long}),
        ("/api/generate", {"model": MODEL, "prompt": "Hi", "options": {"stop": many}}),
        ("/completion", {"prompt": "Hi", "stop": long}),
        (
            "/generate",
            {"session_id": 1, "task_id": 1, "context_id": 1, "sampling_config": {"stop_str": many}},
        ),
    ]
    for path, body in cases:
        r = post(base_url, path, body)
        assert r.status_code == 400, (path, r.text)
    # At the limits a stream runs as usual.
    ok = post(
        base_url,
        "/v1/completions",
        {"model": MODEL, "prompt": "Hi", "max_tokens": 8, "stop": ["y" * 1024] * 64},
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8


# ---- 5. unbounded work ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": CHAT, "temperature": 3},
            "temperature",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": 129}, "n"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": CHAT, "logit_bias": {str(i): 1 for i in range(1025)}},
            "logit_bias",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "Hi", "logit_bias": {"49152": 5}},
            "logit_bias",
        ),
        ("/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": ["a"] * 257}, "input"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 129}, "prompt"),
    ],
)
def test_unbounded_work_is_refused(base_url, path, body, param):
    r = post(base_url, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_ollama_embed_respects_max_batch_inputs(base_url):
    r = post(base_url, "/api/embed", {"model": "all-MiniLM-L6-v2", "input": ["a"] * 257})
    assert r.status_code == 400 and "256" in r.json()["error"]


def test_a_chunked_body_cannot_pass_the_size_limit(base_url):
    def chunks():
        yield b'{"model": "secured-model", "prompt": "'
        for _ in range(20):
            yield b"x" * 1000
        yield b'"}'

    r = httpx.post(
        f"{base_url}{SECURED}/v1/completions",
        content=chunks(),
        headers={**KEY, "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"


def test_a_trickled_body_cannot_hold_the_ingress(base_url):
    """The secured app wants a body within 2 s; this client sends a byte a second."""
    host, port = base_url.removeprefix("http://").split(":")

    async def trickle() -> tuple[bytes, float]:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"POST {SECURED}/v1/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: {KEY['Authorization']}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        started = time.monotonic()
        answer = asyncio.create_task(reader.read(4096))
        for _ in range(20):
            if answer.done():
                break
            writer.write(b"1\r\n \r\n")
            await writer.drain()
            await asyncio.wait({answer}, timeout=1.0)
        head = await asyncio.wait_for(answer, 30)
        writer.close()
        return head, time.monotonic() - started

    head, seconds = asyncio.run(trickle())
    assert head.startswith(b"HTTP/1.1 408"), head[:200]
    assert seconds < 8


# ---- 6. information and access --------------------------------------------------------------
def test_health_is_open_but_slot_detail_needs_a_key(base_url):
    url = f"{base_url}{SECURED}/health"
    anyone = httpx.get(url, params={"include_slots": "true"}, timeout=30)
    assert anyone.status_code == 200
    body = anyone.json()
    assert {"status", "slots_idle", "slots_processing"} <= set(body) and "slots" not in body
    keyed = httpx.get(url, params={"include_slots": "true"}, headers=KEY, timeout=30).json()
    assert len(keyed["slots"]) == keyed["slots_idle"] + keyed["slots_processing"]


def test_cors_preflight_works_with_keys(base_url):
    origin = {"Origin": "https://app.example"}
    pre = httpx.options(
        f"{base_url}{SECURED}/v1/chat/completions",
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=30,
    )
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == "https://app.example"
    denied = httpx.get(f"{base_url}{SECURED}/v1/models", headers=origin, timeout=30)
    assert denied.status_code == 401  # the browser can read why
    assert denied.headers["access-control-allow-origin"] == "https://app.example"


# ---- 12. fields the server does not honour ----------------------------------------------------
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "extra, param, word",
    [
        ({"tools": [TOOL, TOOL]}, "tools", "unique"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
            "'g'",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"functions": [TOOL["function"]]}, "functions", "functions"),
        ({"reasoning_effort": "high"}, "reasoning_effort", "reasoning_effort"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "guided_json"),
        ({"foo": 1}, "foo", "foo"),
        ({"stream_options": {"include_usage": True, "bar": 1}}, "stream_options", "bar"),
        (
            {
                "messages": [
                    {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]},
                    {"role": "tool", "tool_call_id": "1", "content": "sunny"},
                ]
            },
            "messages",
            "function",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            },
            "messages",
            "image input is not supported",  # a text model: nothing is fetched for it
        ),
    ],
)
def test_unhonoured_fields_are_named_in_a_400(base_url, extra, param, word):
    r = post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": CHAT} | extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and word in error["message"]


def test_the_sdk_sees_functions_refused_and_inert_values_accepted(client):
    with pytest.raises(openai.BadRequestError, match="functions"):
        client.chat.completions.create(model=MODEL, messages=CHAT, functions=[TOOL["function"]])
    ok = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=2,
        response_format={"type": "text"},
        extra_body={"tools": [], "stop_token_ids": [2]},
    )
    assert ok.choices[0].message.content is not None


def test_ollama_refuses_images_think_and_bad_formats(base_url):
    for body in (
        {"messages": CHAT, "format": "xml"},
        {"messages": CHAT, "format": {"type": "nonsense"}},
        {"messages": [{"role": "user", "content": "?", "images": ["aGk="]}]},
        {"messages": CHAT, "think": True},
    ):
        r = post(base_url, "/api/chat", {"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"], r.text


# ---- conformance ---------------------------------------------------------------------------
def test_health_always_carries_llamacpp_fields(base_url):
    body = httpx.get(f"{base_url}/health", timeout=30).json()
    assert body["status"] == "ok" and body["slots_idle"] > 0 and body["slots_processing"] >= 0


def test_parrot_ids_are_integers(base_url):
    for ids in (
        {"session_id": 1, "task_id": 1, "context_id": "5"},
        {"session_id": "1", "task_id": 1, "context_id": 5},
        {"session_id": 1, "task_id": 1, "context_id": 5, "parent_context_id": "4"},
    ):
        r = post(base_url, "/fill", {**ids, "text": "x"})
        assert r.status_code == 400, r.text
    assert post(base_url, "/free_context", {"context_id": "5"}).status_code == 400


def test_ollama_lists_and_explains_the_embedding_model(base_url):
    names = [m["name"] for m in httpx.get(f"{base_url}/api/tags", timeout=30).json()["models"]]
    assert f"{MODEL}:latest" in names and "all-MiniLM-L6-v2:latest" in names
    for name in names:  # everything listed answers /api/show
        assert post(base_url, "/api/show", {"model": name}).status_code == 200
    r = post(base_url, "/api/embed", {"model": MODEL, "input": "hi"})
    assert r.status_code == 400 and "all-MiniLM-L6-v2" in r.json()["error"]
    r = post(base_url, "/api/generate", {"model": "all-MiniLM-L6-v2", "prompt": "hi"})
    assert r.status_code == 400 and "does not support generate" in r.json()["error"]
    ok = post(base_url, "/api/embed", {"model": "all-MiniLM-L6-v2", "input": ["a", "b"]})
    assert ok.status_code == 200 and len(ok.json()["embeddings"]) == 2


def test_stream_errors_are_json_events(base_url):
    """A refused stream answers with a status, never a 200 with a broken body."""
    r = post(
        base_url, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "stream": True, "n": 0}
    )
    assert r.status_code == 400 and json.loads(r.text)["error"]["param"] == "n"
