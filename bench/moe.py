"""Mixture-of-experts on the CPU: Shoal's quantized experts against their dequantized
selves, transformers and llama.cpp, on one GGUF file, in one run.

The model: a Qwen3-MoE-shaped checkpoint of about 1.1 B parameters (64 experts, 8 per
token, 10 layers, hidden 1024, experts 512 deep, a 32k vocabulary), random weights
written by the tests' converter (tests/models/gguf_writer.py) with every weight matrix
in Q4_K (tests/models/k_quants.py). No downloads; `--keep DIR` keeps the file for the
next run.

- Shoal (`quantization: auto`: the experts stay Q4_K, every active expert of a
  projection in one kernel call; app/models/quant/experts.py): single-stream decode
  ms/token (32-token prompt, 128 new), and a mixed offline workload (32 requests,
  prompts of 16-256 tokens, 16-128 new) through continuous batching.
- The same engine with `quantization: none` (experts dequantized, one GEMM pair per
  active expert): the same two figures.
- transformers (its Qwen3-MoE model, dense, handed the dequantized weights): the same
  workload in static batches of 16, and single-stream decode.
- llama.cpp (`--llama-cpp DIR` or $SHOAL_LLAMA_CPP, bench/llama_cpp_peer.py): llama-bench's
  decode ms/token on the same file.
- 32 streams over HTTP: the file served by Shoal's Serve app (`build_app`, a local Ray) and
  by llama-server (a slot per client, the same threads), one after the other; each of
  32 clients streams `--serve-rounds` OpenAI completions of 128 tokens (ignore_eos,
  greedy) from a 64-token prompt of token ids (the file's vocabulary is made up, so
  there is no text to chat in). Output tok/s over the whole run.

The last line printed is a JSON object with every figure.
"""

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp_peer as llama_cpp  # noqa: E402
import offline_throughput as offline  # noqa: E402

from app.engine import EngineConfig, LLMEngine  # noqa: E402

SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    num_hidden_layers=10,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    intermediate_size=2048,  # unused: every layer is sparse
    max_position_embeddings=4096,
    initializer_range=0.02,
    eos_token_id=2,
)


def moe_gguf(directory: Path) -> Path:
    """The benchmark's Q4_K file in `directory` (written once)."""
    import gguf

    from tests.models.family_checkpoints import save_family_checkpoint
    from tests.models.gguf_writer import write_gguf

    path = directory / "qwen3-moe-1b-q4_k.gguf"
    if path.exists():
        return path
    start = time.perf_counter()
    checkpoint = save_family_checkpoint(directory / "checkpoint", "qwen3-moe", **SHAPE)
    q4_k = gguf.GGMLQuantizationType.Q4_K
    write_gguf(checkpoint, path, qtype=q4_k, expert_qtype=q4_k)
    for file in checkpoint.iterdir():  # 4 GB of float32 no longer needed
        file.unlink()
    checkpoint.rmdir()
    print(
        f"wrote {path.name} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - start:.0f} s"
    )
    return path


def shoal(path: Path, quantization: str, threads: int, work: list) -> dict:
    engine = LLMEngine(
        EngineConfig(
            model=str(path), quantization=quantization, num_threads=threads, kv_cache_memory_gib=1.0
        )
    )
    vocab = engine.arch.vocab_size
    engine.generate([work[0][0]], offline.SamplingParams(max_tokens=4))  # warm-up
    single_ms, ttft_ms = offline.shoal_single_stream(engine, vocab)
    seconds, tokens = offline.shoal_offline(engine, work)
    figures = {
        "single_stream_ms": round(single_ms, 2),
        "ttft_512_ms": round(ttft_ms, 1),
        "offline_tok_s": round(tokens / seconds, 1),
        "weight_bytes": offline.model_weight_bytes(engine.runner.model),
    }
    print(f"shoal ({quantization}): {figures}")
    del engine
    gc.collect()
    return figures


def transformers_figures(path: Path, work: list, batch: int) -> dict:
    hf = offline.load_transformers_dense(str(path), torch.float32)
    seconds, tokens = offline.hf_static(hf, work, pad_id=0, batch=batch)
    figures = {
        "offline_tok_s": round(tokens / seconds, 1),
        "single_stream_ms": round(offline.hf_single_stream(hf, SHAPE["vocab_size"]), 2),
    }
    print(f"transformers: {figures}")
    del hf
    gc.collect()
    return figures


def completions_tok_s(url: str, model: str, clients: int, rounds: int, salt: int) -> float:
    """Output tok/s of `clients` closed-loop clients, each streaming `rounds` completions
    from prompts no other request shares (`salt` keeps two servers' prompts apart too)."""
    import httpx

    vocab = SHAPE["vocab_size"]

    async def client(http: httpx.AsyncClient, i: int | str) -> int:
        tokens = 0
        for r in range(rounds):
            rng = random.Random(f"{salt}-{i}-{r}")
            body = {
                "model": model,
                "prompt": [rng.randrange(100, vocab) for _ in range(64)],
                "max_tokens": 128,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            usage, chunks = None, 0
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise RuntimeError(chunk["error"])
                        usage = chunk.get("usage") or usage
                        chunks += any(c.get("text") for c in chunk.get("choices", []))
            # the server's own count; else a chunk a token (llama-server streams so)
            tokens += usage["completion_tokens"] if usage else chunks
        return tokens

    async def level(n: int, label: str) -> float:
        limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
        async with httpx.AsyncClient(timeout=900, limits=limits) as http:
            start = time.perf_counter()
            ids = [f"{label}{i}" for i in range(n)]
            tokens = sum(await asyncio.gather(*(client(http, i) for i in ids)))
            return tokens / (time.perf_counter() - start)

    asyncio.run(level(1, "warm-up"))
    return round(asyncio.run(level(clients, "")), 1)


def serve_tok_s(path: Path, threads: int, clients: int, rounds: int) -> float:
    """Shoal's Serve app on a local Ray, serving the file with `quantization: auto` on
    `threads` threads."""
    import ray
    from ray import serve
    from serve_overhead import wait_healthy

    from deployments.builder import build_app
    from deployments.config import AppConfig

    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "models": [
                {
                    "name": "moe",
                    "engine": {
                        "model": str(path),
                        "quantization": "auto",
                        "kv_cache_memory_gib": 1.0,
                        "num_threads": threads,
                    },
                }
            ],
        }
    )
    port = llama_cpp.free_port()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name="moe-bench", route_prefix="/", blocking=False)
        wait_healthy(f"http://127.0.0.1:{port}/health")
        return completions_tok_s(f"http://127.0.0.1:{port}", "moe", clients, rounds, salt=0)
    finally:
        serve.shutdown()
        ray.shutdown()


def llama_server_tok_s(binary: str, path: Path, threads: int, clients: int, rounds: int) -> float:
    with llama_cpp.LlamaServer(binary, str(path), threads, None, clients, 256) as server:
        return completions_tok_s(server.url, "moe", clients, rounds, salt=1)


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", default=None, help="a directory to keep the GGUF file in")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-dense", action="store_true", help="no dequantized Shoal run")
    parser.add_argument("--llama-cpp", default=None, help="directory of llama.cpp's binaries")
    parser.add_argument("--serve-rounds", type=int, default=2, help="requests per client")
    parser.add_argument("--skip-serve", action="store_true", help="no 32-stream HTTP runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(args.keep or scratch)
        directory.mkdir(parents=True, exist_ok=True)
        path = moe_gguf(directory)
        work = [
            (prompt[: 16 + len(prompt) // 2], 16 + out // 2)
            for prompt, out in offline.make_workload(args.requests, SHAPE["vocab_size"], seed=0)
        ]
        result: dict = {"gguf_bytes": path.stat().st_size, "threads": args.threads}
        if not args.skip_hf:  # first: the dense models' 4.4 GB are freed before the next
            hf = transformers_figures(path, work, args.hf_batch)
            result["transformers"] = hf
        ours = shoal(path, "auto", args.threads, work)
        result.update(ours)
        result["weight_over_gguf"] = round(ours["weight_bytes"] / result["gguf_bytes"], 3)
        if not args.skip_dense:
            dense = shoal(path, "none", args.threads, work)
            result["dequantized"] = dense
            result["quantized_speedup_1"] = round(
                dense["single_stream_ms"] / ours["single_stream_ms"], 2
            )
        binary = llama_cpp.find("llama-bench", args.llama_cpp)
        result["llama_bench_ms"] = None
        if binary:
            peer = llama_cpp.llama_bench(binary, str(path), args.threads)
            result["llama_bench_ms"] = peer["decode_ms"]
            result["llama_bench_prompt_512_ms"] = peer["prompt_512_ms"]
            result["single_stream_vs_llama_bench"] = round(
                peer["decode_ms"] / ours["single_stream_ms"], 2
            )
            print(f"llama.cpp (llama-bench): {peer}")
        if not args.skip_hf:
            result["offline_ratio_vs_transformers"] = round(
                ours["offline_tok_s"] / hf["offline_tok_s"], 2
            )
        result["serve_32_tok_s"] = result["llama_server_32_tok_s"] = None
        if not args.skip_serve:
            # llama-server first: its dropped connections were seen right after a Ray's
            # shutdown (bench/serve_overhead.py)
            server = llama_cpp.find("llama-server", args.llama_cpp)
            if server:
                peer = llama_server_tok_s(server, path, args.threads, 32, args.serve_rounds)
                result["llama_server_32_tok_s"] = peer
                print(f"llama-server, 32 streams: {peer} tok/s")
            result["serve_32_tok_s"] = serve_tok_s(path, args.threads, 32, args.serve_rounds)
            print(f"shoal through Serve, 32 streams: {result['serve_32_tok_s']} tok/s")
            if server:
                result["serve_32_over_llama_server"] = round(
                    result["serve_32_tok_s"] / result["llama_server_32_tok_s"], 2
                )
        print(json.dumps(result))


if __name__ == "__main__":
    main()
