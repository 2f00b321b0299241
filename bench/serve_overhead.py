"""Serve overhead: streaming chat through the HTTP ingress against the same engine in-process.

Both sides run the default model with the default engine config, one after the other in
one run. N concurrent clients (1, 8, 32) each send `rounds` chat requests back to back,
streamed, 128 output tokens each (ignore_eos, greedy), with varied user messages.

- in-process: the chat template, an AsyncEngine and incremental detokenization in this
  process, the same work a replica and the ingress do, without Ray, HTTP or JSON.
- serve: `build_app(AppConfig())` on a local Ray (the defaults a 2-core laptop gets),
  httpx streaming clients against the OpenAI endpoint.

Per N: aggregate output tokens/s, p50/p99 TTFT (request sent -> first text), p50 gap
between streamed messages (ITL; a message may carry several tokens), p50 time per output
token after the first (TPOT), and through-Serve / in-process ratios. The peers' figures are the
ones measured on this kind of machine with the same kind of client (see the issue), quoted,
except llama.cpp's: when its `llama-server` is found (`--llama-cpp DIR` or $SHOAL_LLAMA_CPP,
bench/llama_cpp_peer.py), it serves the same GGUF file with the same threads and one slot
per client, and the same clients run against it in the same invocation, before Ray
starts (a request whose connection it closes unanswered goes again: `resent`). With
`--direct-ingress`, Serve runs with Ray's direct ingress on and each level is measured
through the proxy and through the Ingress replica's own HTTP port, in turns (each path's
prompts tagged, so neither finds the other's in the prefix cache). The last line
printed is a JSON object with every figure.
"""

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp_peer as llama_cpp  # noqa: E402

from tests.direct_ingress import direct_ingress_flags, find_direct_ingress  # noqa: E402

# Output tok/s at 32 streams measured on this kind of machine (quoted; llama.cpp's is
# replaced by a side-by-side run when its server binary is found).
PEERS_32 = {"llama.cpp": 195.0, "vllm_cpu_bf16": 500.0}
SYSTEM = "You are a helpful assistant. Answer in detail."
TOPICS = [
    "how tides work",
    "the history of the printing press",
    "why the sky is blue",
    "how a compiler turns code into machine instructions",
    "the rules of chess",
    "photosynthesis",
    "how vaccines train the immune system",
    "the water cycle",
    "what a hash table is and when to use one",
    "the causes of the French Revolution",
    "how airplanes stay in the air",
    "the life cycle of a star",
]


def messages_for(client: int, round_: int, salt: str = "") -> list[dict]:
    """`salt` starts the user's turn: two paths to one engine then share only the system
    prompt in its prefix cache, as two runs against two engines do."""
    topic = TOPICS[(client * 7 + round_) % len(TOPICS)]
    ask = f"{salt}Explain {topic}. (question {client}-{round_})"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]


@dataclass
class Run:
    tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)  # gaps between messages
    tpots: list[float] = field(default_factory=list)  # per request: time per token after the first
    wall_s: float = 0.0
    resent: int = 0  # requests whose connection closed before any response (sent again)

    def summary(self) -> dict:
        ttfts = sorted(self.ttfts)
        return {
            "tok_s": round(self.tokens / self.wall_s, 1),
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
            "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
            "itl_p50_ms": round(1000 * statistics.median(self.itls), 1),
            **(
                {"tpot_p50_ms": round(1000 * statistics.median(self.tpots), 2)}
                if self.tpots
                else {}
            ),
            "requests": len(ttfts),
            "tokens": self.tokens,
            **({"resent": self.resent} if self.resent else {}),
        }


async def closed_loop(n: int, rounds: int, one_request, salt: str = "") -> Run:  # noqa: ANN001
    run = Run()

    async def client(i: int) -> None:
        for r in range(rounds):
            await one_request(run, messages_for(i, r, salt))

    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(n)))
    run.wall_s = time.perf_counter() - start
    return run


def record(run: Run, sent: float, arrivals: list[float], tokens: int) -> None:
    run.tokens += tokens
    if arrivals:
        run.ttfts.append(arrivals[0] - sent)
        run.itls.extend(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
        # A message may carry several tokens (a stream's messages are paced), so the gaps
        # between messages are not the time per token: vLLM's TPOT is.
        if tokens > 1:
            run.tpots.append((arrivals[-1] - arrivals[0]) / (tokens - 1))


# ---- in-process ------------------------------------------------------------------------
def bench_in_process(config, levels: list[tuple[int, int]], max_tokens: int) -> dict:  # noqa: ANN001
    import torch

    from app.engine.async_engine import AsyncEngine
    from app.engine.engine import LLMEngine
    from app.models.source import resolve_model
    from app.protocol import SamplingParams
    from app.protocol.messages import EngineRequest
    from app.text.detokenizer import IncrementalDetokenizer
    from app.text.tokenizer import chat_token_ids, load_tokenizer

    engine_config = config.models[0].engine
    torch.set_num_threads(engine_config.threads)
    engine = AsyncEngine(LLMEngine(engine_config))
    tokenizer = load_tokenizer(resolve_model(engine_config.model))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one_request(run: Run, messages: list[dict]) -> None:
        sent = time.perf_counter()
        ids = chat_token_ids(tokenizer, messages)
        detok = IncrementalDetokenizer(tokenizer, ids)
        arrivals, tokens = [], 0
        async for delta in engine.generate(EngineRequest(uuid.uuid4().hex, ids, params)):
            tokens += len(delta.token_ids)
            if detok.add(delta.token_ids):
                arrivals.append(time.perf_counter())
        record(run, sent, arrivals, tokens)

    results = {}
    try:
        asyncio.run(closed_loop(1, 1, one_request))  # warm-up
        for n, rounds in levels:
            results[n] = asyncio.run(closed_loop(n, rounds, one_request)).summary()
            print(f"in-process N={n:<3} {results[n]}")
    finally:
        engine.shutdown()
    return results


# ---- over HTTP: through Serve, and llama.cpp's server ------------------------------------
def bench_http(
    url: str, model: str, levels: list[tuple[int, int]], max_tokens: int, label: str
) -> dict:
    """The closed-loop levels against an OpenAI chat endpoint at `url`."""
    import httpx

    async def one_request(run: Run, messages: list[dict], client: httpx.AsyncClient) -> None:
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = time.perf_counter()
        arrivals, tokens = [], 0
        for attempt in range(3):
            try:
                stream = client.stream("POST", f"{url}/v1/chat/completions", json=body)
                async with stream as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise RuntimeError(chunk["error"]["message"])
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            arrivals.append(time.perf_counter())
                break
            except httpx.RemoteProtocolError:
                # llama-server (llama-cpp-python 0.3.36's) now and then closes a
                # kept-alive connection unanswered, even with one client; the request goes
                # again on a new one, the lost time still counted. Shoal's never may.
                if arrivals or attempt == 2 or label != "llama.cpp":
                    raise
                run.resent += 1
        record(run, sent, arrivals, tokens or len(arrivals))

    async def level(n: int, rounds: int) -> Run:
        limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            request = lambda run, m: one_request(run, m, client)  # noqa: E731
            return await closed_loop(n, rounds, request, salt=f"[{label}] ")

    asyncio.run(level(1, 1))  # warm-up
    results = {}
    for n, rounds in levels:
        results[n] = asyncio.run(level(n, rounds)).summary()
        print(f"{label:10} N={n:<3} {results[n]}")
    return results


def bench_serve(
    config,  # noqa: ANN001
    levels: list[tuple[int, int]],
    max_tokens: int,
    port: int,
    direct_ingress: bool,
) -> tuple[dict, dict | None]:
    """The levels through Serve's proxy; with `direct_ingress`, each level also through the
    Ingress replica's own HTTP server (Ray Serve's direct ingress) on the same Ray, the two
    in turns (proxy first at odd levels, direct first at even ones). Returns (proxy, direct
    or None)."""
    import ray
    from ray import serve

    from deployments.builder import build_app

    direct_port = llama_cpp.free_port() if direct_ingress else None
    flags = direct_ingress_flags(direct_port) if direct_port else {}
    saved = {k: os.environ.get(k) for k in flags}
    # Read by Serve's controller and replicas at import: set while Ray starts them. A new
    # local Ray ("local"), so that they cannot be lost on a cluster already running.
    os.environ.update(flags)
    try:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name="bench", route_prefix="/", blocking=False)
        wait_healthy(f"http://127.0.0.1:{port}/health")
        model = config.models[0].name
        if direct_port is None:
            return bench_http(f"http://127.0.0.1:{port}", model, levels, max_tokens, "serve"), None
        direct_url = find_direct_ingress(direct_port, skip=port)
        paths = {"serve": f"http://127.0.0.1:{port}", "direct": direct_url}
        measured: dict = {"serve": {}, "direct": {}}
        for i, level in enumerate(levels):
            for label in ("serve", "direct") if i % 2 == 0 else ("direct", "serve"):
                measured[label] |= bench_http(paths[label], model, [level], max_tokens, label)
        return measured["serve"], measured["direct"]
    finally:
        serve.shutdown()
        ray.shutdown()


def bench_llama_server(
    binary: str,
    config,  # noqa: ANN001
    levels: list[tuple[int, int]],
    max_tokens: int,
    port: int | None,
) -> dict:
    """llama-server on the same GGUF file with the same threads, a slot per client."""
    import httpx

    from app.models.source import resolve_model

    engine = config.models[0].engine
    source = resolve_model(engine.model)
    path = str(source.directory / source.gguf_file)
    slots = max(n for n, _ in levels)
    with llama_cpp.LlamaServer(binary, path, engine.threads, port, slots, 512) as server:
        try:
            return bench_http(server.url, "default", levels, max_tokens, "llama.cpp")
        except httpx.RemoteProtocolError as exc:
            # A connection closed with no response three times in a row for one request,
            # or after the response began (see one_request), and the server's log says
            # nothing of it. A new server, once, and the bench says so.
            print(f"llama-server: {exc!r}; its log:\n{server.log_tail()}\nretrying once")
    with llama_cpp.LlamaServer(binary, path, engine.threads, port, slots, 512) as server:
        return bench_http(server.url, "default", levels, max_tokens, "llama.cpp")


def wait_healthy(url: str, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout_s}s")


def bench_kv_offload_pair(config, levels: list[tuple[int, int]], max_tokens: int) -> None:  # noqa: ANN001
    """The same in-process runs with the second KV tier off, then on (`auto`: a disk tier
    on a CPU), one after the other: the tier only writes what the cache evicts, and
    these requests fit, so the two should match."""
    model = config.models[0]
    runs = {}
    for offload in ("off", "auto"):
        engine = model.engine.model_copy(update={"kv_offload": offload})
        changed = config.model_copy(
            update={"models": [model.model_copy(update={"engine": engine})]}
        )
        print(f"kv_offload {offload}")
        runs[offload] = bench_in_process(changed, levels, max_tokens)
        gc.collect()
    result = {"levels": {}}
    for n, _ in levels:
        off, on = runs["off"][n]["tok_s"], runs["auto"][n]["tok_s"]
        result["levels"][n] = {"off": runs["off"][n], "on": runs["auto"][n]}
        result[f"tier_on_over_off_{n}"] = round(on / off, 3)
        print(f"N={n:<3} tier off {off:.1f} tok/s, on {on:.1f} tok/s: {on / off:.3f}")
    print(json.dumps(result))


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # One client gets ten rounds: with four, its figure moved 10-20% between invocations.
    parser.add_argument("--levels", default="1:10,8:2,32:2", help="N:rounds,...")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--serve-only", action="store_true", help="skip the in-process side")
    parser.add_argument(
        "--stream-messages-per-s", type=float, default=None, help="replica's message budget"
    )
    parser.add_argument(
        "--stream-message-interval-s", type=float, default=None, help="a stream's shortest gap"
    )
    parser.add_argument("--quantization", default=None, help="EngineConfig.quantization")
    parser.add_argument("--kv-cache-dtype", default=None, help="EngineConfig.kv_cache_dtype")
    parser.add_argument(
        "--kv-offload-pair",
        action="store_true",
        help="only the in-process side, with the second KV tier off and on (auto): what "
        "the tier costs when nothing is evicted",
    )
    parser.add_argument("--llama-cpp", default=None, help="directory of llama.cpp's binaries")
    parser.add_argument("--llama-port", type=int, default=None, help="default: a free one")
    parser.add_argument(
        "--direct-ingress",
        action="store_true",
        help="also measure through the Ingress replica's own port (no proxy)",
    )
    args = parser.parse_args()
    levels = [tuple(int(x) for x in part.split(":")) for part in args.levels.split(",")]

    from deployments.config import AppConfig

    settings: dict = {"embeddings": {"enabled": False}}
    model: dict = {}
    if args.stream_messages_per_s is not None:
        model["stream_messages_per_s"] = args.stream_messages_per_s
    if args.stream_message_interval_s is not None:
        model["stream_message_interval_s"] = args.stream_message_interval_s
    engine = {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    if engine := {k: v for k, v in engine.items() if v}:
        model["engine"] = engine
    if model:
        settings["models"] = [model]
    config = AppConfig.model_validate(settings)
    print(f"model {config.models[0].name}, threads {config.models[0].engine.threads}")
    if args.kv_offload_pair:
        bench_kv_offload_pair(config, levels, args.max_tokens)
        return
    if args.serve_only:
        bench_serve(config, levels, args.max_tokens, args.port, args.direct_ingress)
        return
    local = bench_in_process(config, levels, args.max_tokens)
    gc.collect()
    from app.models.source import resolve_model

    # llama-server before Ray: its dropped connections were first seen right after Ray's
    # shutdown (README, Benchmarks)
    llama_server = llama_cpp.find("llama-server", args.llama_cpp)
    llama = None
    if llama_server and resolve_model(config.models[0].engine.model).is_gguf:
        llama = bench_llama_server(llama_server, config, levels, args.max_tokens, args.llama_port)
    served, direct = bench_serve(config, levels, args.max_tokens, args.port, args.direct_ingress)
    peers = dict(PEERS_32)

    result: dict = {"levels": {}}
    for n, _ in levels:
        a, b = local[n], served[n]
        result["levels"][n] = {
            "in_process": a,
            "serve": b,
            "throughput_ratio": round(b["tok_s"] / a["tok_s"], 3),
            "ttft_overhead_ms": round(b["ttft_p50_ms"] - a["ttft_p50_ms"], 1),
            "tpot_overhead_ms": round(b["tpot_p50_ms"] - a["tpot_p50_ms"], 2),
        }
        print(
            f"N={n:<3} serve/in-process throughput {result['levels'][n]['throughput_ratio']:.3f}"
            f"  TTFT overhead {result['levels'][n]['ttft_overhead_ms']:+.1f} ms"
            f"  TPOT overhead {result['levels'][n]['tpot_overhead_ms']:+.2f} ms"
        )
    top = max(n for n, _ in levels)
    low = min(n for n, _ in levels)
    result["throughput_ratio_32"] = result["levels"][top]["throughput_ratio"]
    result["ttft_overhead_ms_1"] = result["levels"][low]["ttft_overhead_ms"]
    result["serve_tok_s_32"] = served[top]["tok_s"]
    if llama is not None:
        result["llama_cpp"] = llama
        peers["llama.cpp"] = llama[top]["tok_s"]
        result["tpot_1_ms"] = {
            "serve": served[low]["tpot_p50_ms"],
            "llama.cpp": llama[low]["tpot_p50_ms"],
        }
        for n, _ in levels:
            print(
                f"N={n:<3} serve {served[n]['tok_s']:.1f} tok/s, TPOT {served[n]['tpot_p50_ms']} ms"
                f"  |  llama.cpp {llama[n]['tok_s']:.1f} tok/s, TPOT {llama[n]['tpot_p50_ms']} ms"
                f"  |  ratio {served[n]['tok_s'] / llama[n]['tok_s']:.2f}x"
            )
    if direct is not None:
        result["direct_ingress"] = direct
        for n, _ in levels:
            versus = (
                f"  |  vs llama.cpp {direct[n]['tok_s'] / llama[n]['tok_s']:.2f}x" if llama else ""
            )
            d = direct[n]
            print(
                f"N={n:<3} direct ingress {d['tok_s']:.1f} tok/s, TPOT {d['tpot_p50_ms']} ms"
                f"  |  vs proxy {d['tok_s'] / served[n]['tok_s']:.2f}x{versus}"
            )
    result["peers_measured_here"] = llama is not None
    for peer, tok_s in peers.items():
        result[f"vs_{peer}_32"] = round(served[top]["tok_s"] / tok_s, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
