"""A conversation's 10th turn: previous_response_id (the chain's warm context) against
resending the whole history, TTFT side by side in one run.

In-process app over the real default model (the routes, Ingress, Tokenizer and
ModelServer without Ray, as tests/local_app.py builds them), driven with the official
openai SDK through /v1/responses. For each of `--repeats` conversations, `--turns` - 1
turns are built (user turns of ~`--words` words, replies of `--reply` tokens), then
the last turn is asked three ways, streamed, timing the first output_text.delta:
- chained: `previous_response_id`: the context holds the history; only the new turn
  is computed;
- resend: the whole history as input items, prefix caching on (what a client of a
  server with automatic prefix caching gets while its blocks are still cached);
- resend, no cache: the same on an engine with prefix caching off (a server without
  it, or a history whose blocks were evicted).
TTFT is taken where the SDK sees the event: the app's stream reaches it as it is sent
(`StreamingTransport`; httpx's own ASGI transport would hand it over only whole).
Medians are printed with the ratios; the last line is a JSON object with every figure.
"""

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import openai  # noqa: E402

from app.engine import EngineConfig, LLMEngine  # noqa: E402
from deployments.config import AppConfig  # noqa: E402
from tests.local_app import MODEL, local_app  # noqa: E402

WORDS = [
    "river",
    "stone",
    "light",
    "garden",
    "window",
    "music",
    "paper",
    "winter",
    "city",
    "bread",
    "ocean",
    "market",
]


class StreamingTransport(httpx.AsyncBaseTransport):
    """An ASGI app as httpx's transport, its response handed over at its start and its
    body streamed as the app sends it."""

    def __init__(self, app) -> None:  # noqa: ANN001
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = b"".join([chunk async for chunk in request.stream])
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        started: asyncio.Future = asyncio.get_running_loop().create_future()
        closed = asyncio.Event()
        request_sent = False

        async def receive() -> dict:
            nonlocal request_sent
            if not request_sent:
                request_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await closed.wait()  # the client closed the response: a disconnect
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                started.set_result(message)
            elif message["type"] == "http.response.body":
                chunks.put_nowait(message.get("body", b""))

        url = request.url
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "scheme": url.scheme,
            "path": url.path,
            "raw_path": url.raw_path.split(b"?")[0],
            "query_string": url.query,
            "server": (url.host, url.port),
            "client": ("127.0.0.1", 0),
            "root_path": "",
        }
        app = asyncio.create_task(self.app(scope, receive, send))
        app.add_done_callback(lambda _: chunks.put_nowait(None))  # the body's end
        await asyncio.wait({started, app}, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            app.result()  # the app's failure, if it failed
            raise RuntimeError("the app ended without a response")
        head = started.result()
        stream = _Body(chunks, closed, app)
        return httpx.Response(head["status"], headers=head.get("headers", []), stream=stream)


class _Body(httpx.AsyncByteStream):
    def __init__(self, chunks: asyncio.Queue, closed: asyncio.Event, app: asyncio.Task) -> None:
        self.chunks, self.closed, self.app = chunks, closed, app

    async def __aiter__(self):  # noqa: ANN204
        while (chunk := await self.chunks.get()) is not None:
            yield chunk

    async def aclose(self) -> None:
        self.closed.set()
        await self.app


def user_turn(rng: random.Random, words: int) -> str:
    return "Remember this: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


async def ttft_ms(client: openai.AsyncOpenAI, **kwargs) -> tuple[float, int]:  # noqa: ANN003
    """(ms to the first text delta, prompt tokens)."""
    start = time.perf_counter()
    first = None
    async with client.responses.stream(model=MODEL, temperature=0, **kwargs) as stream:
        async for event in stream:
            if first is None and event.type == "response.output_text.delta":
                first = 1000 * (time.perf_counter() - start)
            if event.type in ("response.completed", "response.incomplete"):
                usage = event.response.usage
    return first or float("nan"), usage.input_tokens


async def conversation(client, rng, args) -> tuple[str, list[dict], str]:  # noqa: ANN001
    """Builds turns 1..n-1; returns the last id, the history as input items, and the
    question of the last turn."""
    history: list[dict] = []
    last = None
    for _ in range(args.turns - 1):
        text = user_turn(rng, args.words)
        reply = await client.responses.create(
            model=MODEL,
            input=text,
            previous_response_id=last,
            max_output_tokens=args.reply,
            temperature=0,
        )
        last = reply.id
        history += [
            {"role": "user", "content": text},
            {"role": "assistant", "content": reply.output_text},
        ]
    return last, history, user_turn(rng, args.words)


async def run_app(app, args, chained: bool) -> dict[str, list[float]]:  # noqa: ANN001
    rng = random.Random(0)
    figures: dict[str, list[float]] = {"chained": [], "resend": [], "prompt_tokens": []}
    transport = StreamingTransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://local") as http:
        client = openai.AsyncOpenAI(base_url="http://local/v1", api_key="x", http_client=http)
        for _ in range(args.repeats):
            # Each way on a conversation of its own (same shape, other words), so that
            # neither finds the other's last turn in the prefix cache.
            limit = {"max_output_tokens": 4}
            if chained:
                last, _, question = await conversation(client, rng, args)
                ms, _ = await ttft_ms(client, input=question, previous_response_id=last, **limit)
                figures["chained"].append(ms)
            _, history, question = await conversation(client, rng, args)
            items = [*history, {"role": "user", "content": question}]
            ms, tokens = await ttft_ms(client, input=items, store=False, **limit)
            figures["resend"].append(ms)
            figures["prompt_tokens"].append(tokens)
    return figures


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--words", type=int, default=60)
    parser.add_argument("--reply", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = AppConfig.model_validate(
        {"embeddings": {"enabled": False}, "assistants": {"enabled": False}}
    )
    results = {}
    for name, caching in (("cache", True), ("no_cache", False)):
        engine = LLMEngine(EngineConfig(kv_cache_memory_gib=1.0, enable_prefix_caching=caching))
        with local_app(config, engine) as (app, _):
            results[name] = asyncio.run(run_app(app, args, chained=caching))
        del engine
    med = statistics.median
    chained = med(results["cache"]["chained"])
    resend = med(results["cache"]["resend"])
    cold = med(results["no_cache"]["resend"])
    tokens = med(results["cache"]["prompt_tokens"])
    print(f"turn {args.turns}: {tokens:.0f} prompt tokens, median of {args.repeats}")
    print(f"  chained (previous_response_id): TTFT {chained:8.1f} ms")
    print(f"  resend, prefix cache on:        TTFT {resend:8.1f} ms  ({resend / chained:.2f}x)")
    print(f"  resend, prefix cache off:       TTFT {cold:8.1f} ms  ({cold / chained:.2f}x)")
    summary = {
        "turn": args.turns,
        "prompt_tokens": tokens,
        "chained_ms": round(chained, 1),
        "resend_cached_ms": round(resend, 1),
        "resend_uncached_ms": round(cold, 1),
        "resend_cached_over_chained": round(resend / chained, 2),
        "resend_uncached_over_chained": round(cold / chained, 2),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
