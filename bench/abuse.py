"""Well-behaved streams with and without hostile clients beside them (issue 13).

16 closed-loop clients stream chat completions (128 tokens each) for a fixed time, once
alone and once while an attacker fires, in rounds (one every --round-s seconds, the next
at once if one takes longer), every hostile request of issue 13:
out-of-range seeds with n=2, a flood of Parrot contexts that are never freed, concurrent
fills of one new context, long streams dropped after half a second (half of them asking
Serve not to watch for disconnects), Ollama templates of 32 KB of `{{if` and prompts with
backslashes, 65 stop strings and 64 stop strings of 1024 characters, 257 embedding inputs,
n=129, 1025 logit_bias entries, an out-of-vocabulary logit_bias key, temperature 3, a
3 MB chunked body, duplicate tools, a schema-less response_format, a regex whose DFA
would blow up, an id_slot outside the slots, slot detail
from /health, and slot saves of a 2000-token context.

Printed: the well-behaved streams' output tokens/s and p50/p99 inter-token latency alone
and under abuse, their failures, the ratio of tokens/s, and what each hostile request got.
Target: no well-behaved stream fails, tokens/s within 20 %. The last line is JSON.

    .venv/bin/python bench/abuse.py            # about 3 minutes
"""

import argparse
import asyncio
import collections
import contextlib
import json
import multiprocessing
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import MODEL, QUESTIONS, Outcome, chat_body, one_stream, percentile  # noqa: E402

CHAT = [{"role": "user", "content": "Hi"}]
PER_ROUND = {"context-flood", "same-new-context"}  # bodies that change every round


async def good_stream(client: httpx.AsyncClient, url: str, rng: random.Random) -> Outcome:
    out = await one_stream(client, url, chat_body(None, rng.choice(QUESTIONS), 128))
    if out.error is None and out.tokens != 128:
        out.error = f"{out.tokens} tokens instead of 128"
    return out


async def well_behaved(url: str, clients: int, seconds: float) -> dict:
    deadline = time.monotonic() + seconds
    results: list[Outcome] = []
    limits = httpx.Limits(max_connections=clients + 4)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def user(i: int) -> None:
            rng = random.Random(i)
            while time.monotonic() < deadline:
                results.append(await good_stream(client, url, rng))

        await asyncio.gather(*(user(i) for i in range(clients)))
    elapsed = time.monotonic() - started
    gaps = sorted(g for r in results for g in r.gaps)
    failed = [r.error for r in results if r.error]
    return {
        "streams": len(results),
        "failed": len(failed),
        "failures": failed[:5],
        "tok_s": round(sum(r.tokens for r in results if not r.error) / elapsed, 1),
        "itl_p50_ms": round(1000 * percentile(gaps, 50), 1) if gaps else None,
        "itl_p99_ms": round(1000 * percentile(gaps, 99), 1) if gaps else None,
    }


# ---- the attacker ------------------------------------------------------------------------
def hostile_requests(rng: random.Random, round_no: int) -> list[tuple[str, str, dict, dict]]:
    """(name, path, json body or {"content": ...}, headers) for one round."""
    ids = {"session_id": 1, "task_id": round_no}
    many_stops = [f"s{i}" for i in range(65)]

    async def chunked():
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(3000):
            yield b"x" * 1000
        yield b'"}'

    return [
        (
            "seed-2^64-n2",
            "/v1/completions",
            {"model": MODEL, "prompt": "Hi", "n": 2, "seed": 2**64 - 1},
            {},
        ),
        (
            "template-32KB-if",
            "/api/generate",
            {"model": MODEL, "prompt": "x", "template": "{{if" * 8000},
            {},
        ),
        (
            "template-backslashes",
            "/api/generate",
            {
                "model": MODEL,
                "prompt": r"C:\Users\x \1",
                "template": "{{ .Prompt }}",
                "stream": False,
                "options": {"num_predict": 4},
            },
            {},
        ),
        (
            "65-stop-strings",
            "/v1/completions",
            {"model": MODEL, "prompt": "Hi", "stop": many_stops},
            {},
        ),
        (
            "64x1024-stop-strings",
            "/v1/completions",
            {"model": MODEL, "prompt": "Hi", "max_tokens": 16, "stop": ["y" * 1024] * 64},
            {},
        ),
        ("embed-257", "/api/embed", {"model": "all-MiniLM-L6-v2", "input": ["a"] * 257}, {}),
        ("n-129", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": 129}, {}),
        (
            "logit-bias-1025",
            "/v1/chat/completions",
            {"model": MODEL, "messages": CHAT, "logit_bias": {str(i): 1 for i in range(1025)}},
            {},
        ),
        (
            "logit-bias-oov",
            "/v1/completions",
            {"model": MODEL, "prompt": "Hi", "logit_bias": {"49152": 5}},
            {},
        ),
        (
            "temperature-3",
            "/v1/chat/completions",
            {"model": MODEL, "messages": CHAT, "temperature": 3},
            {},
        ),
        (
            "chunked-3MB",
            "/v1/completions",
            {"content": chunked},
            {"content-type": "application/json"},
        ),
        (
            "tools",
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": CHAT,
                "tools": [{"type": "function", "function": {"name": "f"}}] * 2,  # names twice
            },
            {},
        ),
        (
            "response-format",
            "/v1/chat/completions",
            {"model": MODEL, "messages": CHAT, "response_format": {"type": "json_schema"}},
            {},
        ),
        (
            "regex-blowup",
            "/v1/chat/completions",
            {"model": MODEL, "messages": CHAT, "guided_regex": "(a|b)*a(a|b){40}", "max_tokens": 8},
            {},
        ),
        ("id-slot-outside", "/completion", {"prompt": "Hi", "id_slot": 10**6}, {}),
        ("health-slots", "/health?include_slots=true", {}, {}),
        *[
            (
                "context-flood",
                "/fill",
                {
                    **ids,
                    "context_id": 10**6 * round_no + k,
                    "token_ids": [rng.randrange(100, 40000) for _ in range(200)],
                },
                {},
            )
            for k in range(4)
        ],
        *[
            (
                "same-new-context",
                "/fill",
                {**ids, "context_id": 9 * 10**8 + round_no, "text": "same"},
                {},
            )
            for _ in range(4)
        ],
        ("slot-save", "/slots/1?action=save", {"filename": "abuse.bin"}, {}),
        ("slot-restore", "/slots/2?action=restore", {"filename": "abuse.bin"}, {}),
    ]


async def attack(
    url: str, stop: asyncio.Event, tally: collections.Counter, round_s: float, skip: set[str]
) -> None:
    rng = random.Random(7)
    async with httpx.AsyncClient(timeout=120) as client:
        # A 2000-token slot for the saves and restores.
        prompt = [rng.randrange(100, 40000) for _ in range(2000)]
        await client.post(
            f"{url}/completion", json={"prompt": prompt, "n_predict": 1, "id_slot": 1}
        )

        encoded: dict[str, bytes] = {}  # the big bodies are encoded once, not every round

        async def send(name: str, path: str, body: dict, headers: dict) -> None:
            try:
                if path.startswith("/health"):
                    r = await client.get(url + path)
                elif "content" in body:
                    r = await client.post(url + path, content=body["content"](), headers=headers)
                else:
                    if name not in encoded or name in PER_ROUND:
                        encoded[name] = json.dumps(body).encode()
                    headers = {**headers, "content-type": "application/json"}
                    r = await client.post(url + path, content=encoded[name], headers=headers)
                tally[f"{name} {r.status_code}"] += 1
            except httpx.HTTPError as exc:
                tally[f"{name} {type(exc).__name__}"] += 1

        async def dropped(i: int) -> None:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 2000,
                "ignore_eos": True,
                "stream": True,
            }
            headers = {"x-request-disconnect-disabled": "?1"} if i % 2 else {}
            try:
                async with asyncio.timeout(0.5):
                    async with client.stream(
                        "POST", f"{url}/v1/chat/completions", json=body, headers=headers
                    ) as r:
                        async for _ in r.aiter_bytes():
                            pass
            except (TimeoutError, httpx.HTTPError):
                pass
            tally["dropped-stream"] += 1

        round_no = 0
        while not stop.is_set():
            round_no += 1
            started = time.monotonic()
            batch = [r for r in hostile_requests(rng, round_no) if r[0] not in skip]
            drops = 0 if "dropped-stream" in skip else 10
            await asyncio.gather(
                *(send(*request) for request in batch), *(dropped(i) for i in range(drops))
            )
            tally["rounds"] += 1
            pause = max(0.0, round_s - (time.monotonic() - started))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)


def attacker_process(url: str, round_s: float, skip: set[str], stop, results) -> None:  # noqa: ANN001
    """The attacker in a process of its own: its client-side work (encoding megabytes of
    bodies) must not stall the measured clients' event loop."""

    async def run() -> dict:
        done = asyncio.Event()
        tally: collections.Counter = collections.Counter()
        task = asyncio.create_task(attack(url, done, tally, round_s, skip))
        while not stop.is_set():
            await asyncio.sleep(0.1)
        done.set()
        await task
        return dict(sorted(tally.items()))

    results.put(asyncio.run(run()))


def with_abuse(
    url: str, clients: int, seconds: float, round_s: float, skip: set[str]
) -> tuple[dict, dict]:
    ctx = multiprocessing.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    attacker = ctx.Process(target=attacker_process, args=(url, round_s, skip, stop, results))
    attacker.start()
    time.sleep(2)  # its first round (and the slot it saves) is under way
    result = asyncio.run(well_behaved(url, clients, seconds))
    stop.set()
    tally = results.get(timeout=300)
    attacker.join(60)
    return result, tally


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--round-s", type=float, default=3.0, help="one attack round this often")
    parser.add_argument("--skip", default="", help="hostile requests to leave out, by name")
    parser.add_argument("--port", type=int, default=8013)
    args = parser.parse_args()

    import ray
    from ray import serve

    from bench.serve_overhead import wait_healthy
    from deployments.builder import build_app
    from deployments.config import AppConfig

    slots = tempfile.mkdtemp(prefix="shoal-abuse-slots-")
    config = AppConfig.model_validate({"models": [{"slot_save_path": slots}]})
    url = f"http://127.0.0.1:{args.port}"
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(config), name="abuse", route_prefix="/", blocking=False)
        wait_healthy(f"{url}/health")
        asyncio.run(well_behaved(url, 2, 5))  # warm-up
        alone = asyncio.run(well_behaved(url, args.clients, args.seconds))
        print(f"alone        {alone}")
        skip = set(filter(None, args.skip.split(",")))
        abused, tally = with_abuse(url, args.clients, args.seconds, args.round_s, skip)
        print(f"under abuse  {abused}")
        print("hostile requests and their answers:")
        for key, count in tally.items():
            print(f"  {key:40s} {count}")
        handle = serve.get_deployment_handle(f"ModelServer:{MODEL}", app_name="abuse")
        stats = handle.stats.remote().result(timeout_s=30)
    finally:
        serve.shutdown()
        ray.shutdown()
    result = {
        "alone": alone,
        "under_abuse": abused,
        "tok_s_ratio": round(abused["tok_s"] / alone["tok_s"], 3),
        "itl_p99_ratio": round(abused["itl_p99_ms"] / alone["itl_p99_ms"], 3),
        "hostile": tally,
        "contexts_after": stats["num_contexts"],
        "context_drops": stats["num_context_drops"],
        "context_evictions": stats["num_context_evictions"],
        "server_errors": sum(c for k, c in tally.items() if k.split()[-1].startswith("5")),
    }
    print(
        f"tok/s under abuse / alone: {result['tok_s_ratio']:.3f}; p99 ITL ratio "
        f"{result['itl_p99_ratio']:.2f}; failed well-behaved streams: {abused['failed']}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
