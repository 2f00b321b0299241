"""The OpenAI API through the live Serve app, with the official openai client."""

import asyncio
import base64
import json
import struct
import time

import httpx
import openai
import pytest

from tests.serve.conftest import MODEL

CHAT = [{"role": "user", "content": "Name three fruits."}]


def test_models(client, base_url):
    ids = [m.id for m in client.models.list().data]
    assert MODEL in ids
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_usage_and_streaming_match(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert text and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_message_kinds_and_max_completion_tokens(client):
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}],
        },
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=5, temperature=0
    )
    assert out.usage.completion_tokens <= 5


def test_vllm_extensions_ignore_eos_and_top_k(client):
    # "Hi" makes the model answer in a few tokens and stop; ignore_eos runs to the limit.
    short = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say OK."}],
        max_tokens=200,
        temperature=0,
    )
    assert short.usage.completion_tokens < 200
    full = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say OK."}],
        max_tokens=200,
        extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert full.usage.completion_tokens == 200 and full.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", extra_body={"top_k": -3})


def test_completion_logprobs_and_n(client):
    out = client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(len(t) == 3 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    streamed = client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=3, stream=True
    )
    offsets, tokens = [], []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs:
            offsets += chunk.choices[0].logprobs.text_offset
            tokens += chunk.choices[0].logprobs.tokens
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    two = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, n=2, seed=5
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert 2 <= two.usage.completion_tokens <= 20


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 for c in content)


def test_seed_reproducible(client):
    kwargs = dict(
        model=MODEL, prompt="My favourite animal is", max_tokens=12, temperature=1.0, seed=1234
    )
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_never_leak(client, stream):
    base = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0
    )
    text = base.choices[0].text
    assert len(text) > 6
    stop = text[3:6]  # likely spans a token boundary
    kwargs = dict(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[stop])
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ]
        assert reason == ["stop"]
    else:
        out = client.completions.create(**kwargs)
        got, reason = out.choices[0].text, out.choices[0].finish_reason
        assert reason == "stop"
    assert got == text[: text.index(stop)]


def test_embeddings(client, base_url):
    out = client.embeddings.create(model="all-MiniLM-L6-v2", input=["a cat", "a kitten", "tax law"])
    vecs = [d.embedding for d in out.data]
    assert len(vecs) == 3 and len(vecs[0]) == 384
    dot = lambda a, b: sum(x * y for x, y in zip(a, b, strict=True))  # noqa: E731
    assert abs(dot(vecs[0], vecs[0]) - 1) < 1e-4
    assert dot(vecs[0], vecs[1]) > dot(vecs[0], vecs[2])
    assert out.usage.prompt_tokens > 0
    b64 = httpx.post(
        f"{base_url}/embeddings",  # the unprefixed alias
        json={"model": "all-MiniLM-L6-v2", "input": "a cat", "encoding_format": "base64"},
    ).json()
    decoded = struct.unpack("<384f", base64.b64decode(b64["data"][0]["embedding"]))
    assert max(abs(x - y) for x, y in zip(decoded, vecs[0], strict=True)) < 1e-5


def test_concurrent_streams_are_batched(client, model_stats):
    async def one(i: int) -> str:
        aclient = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="x", max_retries=0)
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text = ""
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
        return text

    async def main() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(16)))

    texts = asyncio.run(main())
    assert len(texts) == 16 and all(texts)
    assert model_stats()["max_batch_num_seqs"] > 1


def test_disconnect_frees_blocks(base_url, model_stats):
    body = {
        "model": MODEL,
        "prompt": "Write a long story.",
        "max_tokens": 1000,
        "stream": True,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        lines = 0
        for line in r.iter_lines():
            if line.startswith("data:"):
                lines += 1
            if lines >= 3:
                break
    deadline = time.time() + 20
    while time.time() < deadline:
        stats = model_stats()
        if stats["num_running"] == 0 and stats["kv_blocks_used"] == 0:
            break
        time.sleep(0.2)
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0


BAD = [
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "temperature": -1},
        400,
        "temperature",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": 0}, 400, "n"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 0},
        400,
        "max_tokens",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_completion_tokens": -5},
        400,
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "presence_penalty": 3},
        400,
        "presence_penalty",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "logit_bias": {"abc": 1}},
        400,
        "logit_bias",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "top_logprobs": 50, "logprobs": True},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 100000},
        400,
        "max_tokens",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [99999999]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 9}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": []}, 400, "input"),
    ("/v1/embeddings", {"input": "x" * 10, "encoding_format": "hex"}, 400, "encoding_format"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_input_gets_openai_errors(base_url, path, body, status, param):
    r = httpx.post(base_url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    ok = httpx.get(f"{base_url}/v1/models", timeout=30)
    assert ok.status_code == 200


def test_context_overflow_names_both_numbers(base_url):
    r = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": MODEL, "prompt": "hello " * 10, "max_tokens": 9000},
        timeout=60,
    )
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "8192" in msg and "9000" in msg


def test_malformed_json_and_request_id(base_url):
    r = httpx.post(
        f"{base_url}/v1/chat/completions",
        content=b"{not json",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()
    assert r.headers.get("x-request-id")


def test_api_keys_body_limit_and_health(base_url):
    secured = f"{base_url}/secured"
    assert httpx.get(f"{secured}/health", timeout=30).status_code == 200
    r = httpx.get(f"{secured}/v1/models", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = httpx.get(
        f"{secured}/v1/models", headers={"Authorization": "Bearer sk-wrong"}, timeout=30
    )
    assert bad.status_code == 401
    good = httpx.get(
        f"{secured}/v1/models", headers={"Authorization": "Bearer sk-test-2"}, timeout=30
    )
    assert good.status_code == 200 and good.json()["data"][0]["id"] == "secured-model"
    big = httpx.post(
        f"{secured}/v1/completions",
        headers={"Authorization": "Bearer sk-test-1"},
        json={"model": "secured-model", "prompt": "x" * 10000},
        timeout=30,
    )
    assert big.status_code == 413 and "error" in big.json()


def test_client_request_id_is_returned(base_url):
    r = httpx.post(
        f"{base_url}/v1/completions",
        headers={"X-Request-Id": "trace-me-42"},
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200
    assert "trace-me-42" in r.headers["x-request-id"]
    assert r.json()["id"].startswith("cmpl-trace-me-42.")


def test_prometheus_metrics(client, base_url):
    client.completions.create(
        model=MODEL, prompt="Metrics", max_tokens=4, temperature=0, stream=False
    )
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    assert 'shoal_requests_total{path="/v1/completions",status="200"}' in text
    ttft = [
        ln for ln in text.splitlines() if ln.startswith("shoal_time_to_first_token_seconds_count")
    ]
    assert ttft and float(ttft[0].split()[-1]) >= 1
    assert "shoal_inter_token_latency_seconds_bucket" in text
    assert f'shoal_kv_cache_usage_ratio{{model="{MODEL}"' in text
    assert f'shoal_kv_tier_hit_tokens{{model="{MODEL}"' in text  # the second KV tier's
    assert f'shoal_spec_accepted_tokens{{model="{MODEL}"' in text  # speculative decoding's
    assert "shoal_prompt_tokens_total" in text


def test_overload_answers_503_with_retry_after(base_url):
    """At most 2 running + 1 queued; the rest are refused at once instead of queueing."""
    url = f"{base_url}/secured/v1/chat/completions"
    headers = {"Authorization": "Bearer sk-test-1"}
    body = {
        "model": "secured-model",
        "messages": [{"role": "user", "content": "Count to a hundred."}],
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
    }

    async def one(client: httpx.AsyncClient) -> tuple[int, str | None, bytes, float]:
        started = time.perf_counter()
        async with client.stream("POST", url, json=body, headers=headers) as r:
            raw = await r.aread()
            return r.status_code, r.headers.get("retry-after"), raw, started

    async def burst() -> list:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(8)))

    results = asyncio.run(burst())
    statuses = sorted(status for status, *_ in results)
    # Serve counts a request as queued while it is being routed, so a burst that arrives at
    # once may admit as few as one; the rest must be refused at once, never queued.
    assert statuses.count(200) >= 1 and statuses.count(503) >= 1, results
    assert set(statuses) <= {200, 503}
    for status, retry_after, raw, _ in results:
        if status == 503:
            payload = json.loads(raw)
            assert retry_after == "1"
            assert payload["error"]["type"] == "service_unavailable"
            assert payload["error"]["code"] == "overloaded"
    after = httpx.post(url, json={**body, "stream": False}, headers=headers, timeout=120)
    assert after.status_code == 200


def test_speculative_decoding_through_serve(base_url):
    """The secured app's model speculates (prompt lookup: tests/serve/conftest.py). A
    greedy stream of an answer that copies its prompt is the default app's answer, token
    for token, though its steps yield several tokens; /metrics counts the proposals."""
    ask = "Repeat exactly: alpha beta gamma delta, alpha beta gamma delta, alpha beta gamma."
    messages = [{"role": "user", "content": ask}]
    plain = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    want = plain.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0
    )
    secured = openai.OpenAI(base_url=f"{base_url}/secured/v1", api_key="sk-test-1", max_retries=0)
    stream = secured.chat.completions.create(
        model="secured-model",
        messages=messages,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens
    deadline, accepted = time.time() + 20, 0.0
    while time.time() < deadline and not accepted:  # figures come with heartbeats
        metrics = httpx.get(
            f"{base_url}/secured/metrics", headers={"Authorization": "Bearer sk-test-1"}
        ).text
        lines = [ln for ln in metrics.splitlines() if ln.startswith("shoal_spec_accepted_tokens{")]
        accepted = sum(float(ln.split()[-1]) for ln in lines)
        time.sleep(0.5)
    assert accepted > 0
