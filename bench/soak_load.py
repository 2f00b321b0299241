"""The soak's clients (bench/soak.py): closed-loop users that walk every dialect in a
shuffled cycle, each HTTP call recorded with its dialect, times and status.

A call's status is its HTTP status, "<status> stream-error" when a 2xx stream carried an
error event (OpenAI/llama.cpp/Parrot `data: {"error": ...}`, Ollama's NDJSON `{"error"}`,
Anthropic/Responses/Assistants `event: error`, `response.failed`, `thread.run.failed`),
or the client exception's name when no answer came (ReadError, RemoteProtocolError ...).
A "cancel" call is a stream the client closes after its first chunks (counted as its
status, 2xx when the stream had started)."""

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

MODEL = "smollm2-135m-instruct"
EMBEDDER = "all-MiniLM-L6-v2"
QUESTIONS = [
    "Explain how tides work.",
    "Give three tips for learning a language.",
    "Describe a sunrise over the sea.",
    "What makes bread rise?",
    "Why do cats purr?",
    "How does a bicycle stay upright?",
]
ERROR_EVENTS = {"error", "response.failed", "thread.run.failed"}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rain": {"type": "boolean"}},
    "required": ["city", "rain"],
    "additionalProperties": False,
}


@dataclass
class Call:
    dialect: str
    sent: float  # time.monotonic()
    ended: float
    status: str
    detail: str | None = None
    since: float | None = None  # the scenario's first call, for one that uses its state


@dataclass
class Soak:
    """What every user saw; `tokens` bounds each request's output."""

    url: str
    tokens: int = 16
    calls: list[Call] = field(default_factory=list)
    assistant: str | None = None

    async def send(
        self,
        client: httpx.AsyncClient,
        dialect: str,
        method: str,
        path: str,
        body: dict | None = None,
        cancel_after: int | None = None,
        stream: bool | None = None,
        since: float | None = None,
    ) -> dict | None:
        """One call, recorded; its JSON (None for streams and failures). A stream (`stream`,
        default: the body's `"stream"`) is read to its end, or `cancel_after` chunks.
        `since`: when the scenario made the replica state this call relies on."""
        sent = time.monotonic()
        status, detail, answer = "?", None, None
        if stream is None:
            stream = bool(body and body.get("stream"))
        try:
            if stream:
                status, detail = await self._stream(client, method, path, body, cancel_after)
            else:
                r = await client.request(method, self.url + path, json=body)
                status = str(r.status_code)
                if r.status_code < 300:
                    answer = r.json()
                else:
                    detail = r.text[:200]
        except httpx.HTTPError as exc:
            status, detail = type(exc).__name__, repr(exc)[:200]
        self.calls.append(Call(dialect, sent, time.monotonic(), status, detail, since))
        return answer

    async def _stream(
        self,
        client: httpx.AsyncClient,
        method: str,
        path: str,
        body: dict,
        cancel_after: int | None,
    ) -> tuple[str, str | None]:
        async with client.stream(method, self.url + path, json=body) as r:
            if r.status_code >= 300:
                return str(r.status_code), (await r.aread()).decode(errors="replace")[:200]
            chunks = 0
            async for line in r.aiter_lines():
                error = stream_error(line)
                if error is not None:
                    return f"{r.status_code} stream-error", error
                chunks += bool(line.strip())
                if cancel_after is not None and chunks >= cancel_after:
                    return str(r.status_code), "cancelled"  # leaving the block closes it
            return str(r.status_code), None


def stream_error(line: str) -> str | None:
    """The error a stream's line carries, in any dialect's framing; None if none."""
    if line.startswith("event: "):
        return line if line[7:].strip() in ERROR_EVENTS else None
    text = line[6:] if line.startswith("data: ") else line
    if not text.startswith("{"):
        return None
    try:
        event = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(event, dict) and event.get("error"):
        return text[:200]
    return None


# ---- the dialects: one function each, (soak, client, rng, user number, iteration) -------
def chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


async def openai_chat(s: Soak, c: httpx.AsyncClient, rng: random.Random, *_: int) -> None:
    body = {"model": MODEL, "messages": chat(rng.choice(QUESTIONS)), "max_tokens": s.tokens}
    await s.send(c, "openai_chat", "POST", "/v1/chat/completions", body)


async def openai_chat_stream(s: Soak, c: httpx.AsyncClient, rng: random.Random, *_: int) -> None:
    body = {"model": MODEL, "messages": chat(rng.choice(QUESTIONS)), "max_tokens": s.tokens}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    await s.send(c, "openai_chat_stream", "POST", "/v1/chat/completions", body)


async def openai_completions(s: Soak, c: httpx.AsyncClient, rng: random.Random, *_: int) -> None:
    body = {"model": MODEL, "prompt": rng.choice(QUESTIONS), "max_tokens": s.tokens}
    body["stream"] = rng.random() < 0.5
    await s.send(c, "openai_completions", "POST", "/v1/completions", body)


async def structured(s: Soak, c: httpx.AsyncClient, rng: random.Random, *_: int) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    body = {"model": MODEL, "messages": chat("Weather in Paris, as JSON."), "max_tokens": 32}
    body["response_format"] = fmt
    await s.send(c, "structured_json_schema", "POST", "/v1/chat/completions", body)


async def embeddings(s: Soak, c: httpx.AsyncClient, rng: random.Random, *_: int) -> None:
    body = {"model": EMBEDDER, "input": rng.sample(QUESTIONS, 2)}
    await s.send(c, "openai_embeddings", "POST", "/v1/embeddings", body)


async def responses(s: Soak, c: httpx.AsyncClient, rng: random.Random, *_: int) -> None:
    """Streamed or not; a third stored (a chain context on the replica), then deleted
    (its context freed; only unstreamed ones, whose id the bench reads)."""
    stream = rng.random() < 0.5
    store = not stream and rng.random() < 0.67
    body = {"model": MODEL, "input": rng.choice(QUESTIONS), "max_output_tokens": s.tokens}
    body |= {"store": store, "stream": stream}
    if stream or not store:
        await s.send(c, "responses", "POST", "/v1/responses", body)
        return
    t = time.monotonic()
    answer = await s.send(c, "responses", "POST", "/v1/responses", body)
    if answer is not None:
        await s.send(c, "responses", "DELETE", f"/v1/responses/{answer['id']}", since=t)


async def anthropic(s: Soak, c: httpx.AsyncClient, rng: random.Random, *_: int) -> None:
    body = {"model": MODEL, "messages": chat(rng.choice(QUESTIONS)), "max_tokens": s.tokens}
    body["stream"] = rng.random() < 0.5
    await s.send(c, "anthropic_messages", "POST", "/v1/messages", body)


async def ollama_chat(s: Soak, c: httpx.AsyncClient, rng: random.Random, *_: int) -> None:
    body = {"model": MODEL, "messages": chat(rng.choice(QUESTIONS))}
    body |= {"stream": rng.random() < 0.5, "options": {"num_predict": s.tokens}}
    await s.send(c, "ollama_chat", "POST", "/api/chat", body)


async def ollama_generate(s: Soak, c: httpx.AsyncClient, rng: random.Random, *_: int) -> None:
    body = {"model": MODEL, "prompt": rng.choice(QUESTIONS)}
    body |= {"stream": rng.random() < 0.5, "options": {"num_predict": s.tokens}}
    await s.send(c, "ollama_generate", "POST", "/api/generate", body)


async def llamacpp(s: Soak, c: httpx.AsyncClient, rng: random.Random, *_: int) -> None:
    body = {"prompt": rng.choice(QUESTIONS), "n_predict": s.tokens, "stream": rng.random() < 0.5}
    await s.send(c, "llamacpp_completion", "POST", "/completion", body)


async def parrot(s: Soak, c: httpx.AsyncClient, rng: random.Random, user: int, k: int) -> None:
    """A context filled, forked (a child filled from it), generated in, both freed."""
    ids = {"session_id": user, "task_id": k}
    parent = (user + 1) * 10**9 + 2 * k
    child = parent + 1
    d, t = "parrot_contexts", time.monotonic()
    first = {**ids, "context_id": parent, "text": rng.choice(QUESTIONS)}
    await s.send(c, d, "POST", "/fill", first)
    fork = {**ids, "context_id": child, "parent_context_id": parent, "text": " Answer:"}
    await s.send(c, d, "POST", "/fill", fork, since=t)
    gen = {**ids, "context_id": child, "sampling_config": {"max_gen_length": s.tokens}}
    streamed = rng.random() < 0.5
    path = "/generate_stream" if streamed else "/generate"
    await s.send(c, d, "POST", path, gen, stream=streamed, since=t)
    for cid in (child, parent):
        await s.send(c, d, "POST", "/free_context", {"context_id": cid}, since=t)


async def assistants(s: Soak, c: httpx.AsyncClient, rng: random.Random, *_: int) -> None:
    """A thread with one message, a streamed run, the thread deleted (its context freed)."""
    d, t = "assistants_runs", time.monotonic()
    thread = await s.send(c, d, "POST", "/v1/threads", {"messages": chat(rng.choice(QUESTIONS))})
    if thread is None or s.assistant is None:
        return
    run = {"assistant_id": s.assistant, "stream": True, "max_completion_tokens": s.tokens}
    await s.send(c, d, "POST", f"/v1/threads/{thread['id']}/runs", run, since=t)
    await s.send(c, d, "DELETE", f"/v1/threads/{thread['id']}", since=t)


async def cancel(s: Soak, c: httpx.AsyncClient, rng: random.Random, *_: int) -> None:
    """A long stream of some dialect, closed by the client after its first chunks."""
    q, n = rng.choice(QUESTIONS), 256
    path, body = rng.choice(
        [
            ("/v1/chat/completions", {"model": MODEL, "messages": chat(q), "max_tokens": n}),
            ("/v1/messages", {"model": MODEL, "messages": chat(q), "max_tokens": n}),
            ("/api/generate", {"model": MODEL, "prompt": q, "options": {"num_predict": n}}),
            ("/completion", {"prompt": q, "n_predict": n}),
            ("/v1/responses", {"model": MODEL, "input": q, "max_output_tokens": n, "store": False}),
        ]
    )
    await s.send(c, "cancel_mid_stream", "POST", path, body | {"stream": True}, cancel_after=3)


Scenario = Callable[[Soak, httpx.AsyncClient, random.Random, int, int], Awaitable[None]]
SCENARIOS: list[Scenario] = [
    openai_chat, openai_chat_stream, openai_chat_stream, openai_completions, structured,
    embeddings, responses, anthropic, ollama_chat, ollama_generate, llamacpp, parrot,
    assistants, cancel,
]  # fmt: skip
# Every dialect that must have answered 2xx (the names the calls carry).
DIALECTS = [
    "openai_chat", "openai_chat_stream", "openai_completions", "structured_json_schema",
    "openai_embeddings", "responses", "anthropic_messages", "ollama_chat", "ollama_generate",
    "llamacpp_completion", "parrot_contexts", "assistants_runs", "cancel_mid_stream",
]  # fmt: skip


async def setup(s: Soak) -> None:
    """The assistant every run uses."""
    async with httpx.AsyncClient(timeout=120) as c:
        body = {"model": MODEL, "instructions": "Answer in one short sentence."}
        made = await s.send(c, "assistants_runs", "POST", "/v1/assistants", body)
        s.assistant = made["id"] if made else None


async def every_dialect_once(s: Soak) -> None:
    """Each scenario once, one after the other (the warm-up's first pass)."""
    async with httpx.AsyncClient(timeout=120) as c:
        for k, scenario in enumerate(SCENARIOS):
            await scenario(s, c, random.Random(k), 0, k)


async def users(s: Soak, clients: int, until: float) -> None:
    """`clients` closed-loop users until the monotonic time `until`."""
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(timeout=300, limits=limits) as c:

        async def user(i: int) -> None:
            rng, k = random.Random(1000 + i), 0
            while time.monotonic() < until:
                cycle = rng.sample(SCENARIOS, len(SCENARIOS))
                for scenario in cycle:
                    if time.monotonic() >= until:
                        return
                    k += 1
                    await scenario(s, c, rng, i + 1, k)

        await asyncio.gather(*(user(i) for i in range(clients)))
