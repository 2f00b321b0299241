"""Closed-loop streaming chat clients for the benchmarks: what each request saw."""

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

MODEL = "smollm2-135m-instruct"
QUESTIONS = [
    "Explain how tides work.",
    "Give three tips for learning a language.",
    "Describe a sunrise over the sea.",
    "What makes bread rise?",
    "Why do cats purr?",
    "How does a bicycle stay upright?",
]


@dataclass
class Outcome:
    sent: float
    ended: float
    ttft: float | None = None
    tokens: int = 0
    cached: int = 0
    prompt: int = 0
    error: str | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between text chunks


@dataclass
class Load:
    outcomes: list[Outcome] = field(default_factory=list)

    def window(self, start: float, end: float) -> list[Outcome]:
        return [o for o in self.outcomes if start <= o.sent and o.ended <= end]

    def summary(self, seconds: float) -> dict:
        ok = [o for o in self.outcomes if o.error is None]
        ttfts = sorted(o.ttft for o in ok if o.ttft is not None)
        return {
            "requests": len(self.outcomes),
            "failed": len(self.outcomes) - len(ok),
            "tok_s": round(sum(o.tokens for o in ok) / seconds, 1),
            "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1) if ttfts else None,
            "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1) if ttfts else None,
        }


def percentile(values: list[float], p: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[p - 1]
        if len(values) > 1
        else values[0]
    )


async def one_stream(client: httpx.AsyncClient, url: str, body: dict) -> Outcome:
    out = Outcome(sent=time.monotonic(), ended=0.0)
    last: float | None = None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}"
                await r.aread()
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        out.error = event["error"]["message"]
                    elif event.get("usage"):
                        usage = event["usage"]
                        out.tokens = usage["completion_tokens"]
                        out.prompt = usage["prompt_tokens"]
                        out.cached = usage["prompt_tokens_details"]["cached_tokens"]
                    elif any(c["delta"].get("content") for c in event["choices"]):
                        now = time.monotonic()
                        if out.ttft is None:
                            out.ttft = now - out.sent
                        else:
                            out.gaps.append(now - last)
                        last = now
    except httpx.HTTPError as exc:
        out.error = repr(exc)
    out.ended = time.monotonic()
    return out


def chat_body(system: str | None, question: str, max_tokens: int) -> dict:
    messages = [{"role": "user", "content": question}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def closed_loop(url: str, clients: int, seconds: float, make_body, load: Load) -> None:
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=120) as client:

        async def user(i: int) -> None:
            rng = random.Random(i)
            while time.monotonic() < deadline:
                load.outcomes.append(await one_stream(client, url, make_body(rng)))

        await asyncio.gather(*(user(i) for i in range(clients)))


def mixed(max_tokens: int):
    return lambda rng: chat_body(None, rng.choice(QUESTIONS), max_tokens)
