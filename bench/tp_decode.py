"""Tensor parallelism on this machine: decode with TP=1 against TP=N, one run, same cores.

Two cases: a SmolLM2-shaped Llama with random weights but 8 query and 4 KV heads (SmolLM2's 9
and 3 do not split in two) at TP=2, and SmolLM2 itself at TP=3. TP=1 runs one engine
process with every core; TP=N runs rank 0 in an engine process and
ranks 1..N-1 as shard processes, each with cores/N threads, all-reducing over gloo (NCCL
on GPUs). Both decode the same greedy requests (128-token prompts, EOS ignored) at
batch 1 and at batch B, timed from the first token to the last:
- per-step latency at batch 1 (ms/token),
- decode throughput at batch B (output tokens/s).
On a CPU with few cores the all-reduces (2 per layer) can cost more than the split saves:
the figures say which. The last line printed is a JSON object with every figure.
"""

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine import EngineConfig  # noqa: E402
from app.engine.engine_process import EngineProcess  # noqa: E402
from app.protocol import SamplingParams  # noqa: E402
from app.protocol.messages import EngineRequest  # noqa: E402
from tests.helpers import free_local_address, spawn_local_shards, stop_local_shards  # noqa: E402


async def decode(engine: EngineProcess, batch: int, new_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    firsts, lasts, counts = [], [], []

    async def one(i: int) -> None:
        first = last = None
        n = 0
        request = EngineRequest(f"b{batch}-{seed}-{i}", prompts[i], params)
        async for delta in engine.generate(request):
            now = time.perf_counter()
            first = first or now
            last = now
            n += len(delta.token_ids)
        firsts.append(first)
        lasts.append(last)
        counts.append(n)

    await asyncio.gather(*(one(i) for i in range(batch)))
    span = max(lasts) - max(firsts)  # every sequence decoding
    decode_tokens = sum(counts) - batch
    return {
        "ms_per_step": round(1000 * span / (new_tokens - 1), 2),
        "tok_s": round(decode_tokens / (max(lasts) - min(firsts)), 1),
    }


def measure(config: EngineConfig, batch: int, new_tokens: int) -> dict:
    master = free_local_address() if config.tensor_parallel_size > 1 else None
    shards = spawn_local_shards(config, master) if master else []
    engine = EngineProcess(config, tp_master=master)
    try:
        asyncio.run(decode(engine, 2, 8, seed=99))  # warm-up
        single = asyncio.run(decode(engine, 1, new_tokens, seed=1))
        batched = asyncio.run(decode(engine, batch, new_tokens, seed=2))
    finally:
        engine.shutdown()
        stop_local_shards(shards)
    return {
        "batch1_ms_per_step": single["ms_per_step"],
        f"batch{batch}_tok_s": batched["tok_s"],
        f"batch{batch}_ms_per_step": batched["ms_per_step"],
    }


def smollm2_shaped_random(directory: Path) -> Path:
    """SmolLM2-135M's sizes with 8 query / 4 KV heads of 64 (hidden 512), random weights."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def compare(model: str, label: str, tp: int, args: argparse.Namespace) -> dict:
    results = {}
    for size in (1, tp):
        config = EngineConfig(
            model=model, dtype=args.dtype, tensor_parallel_size=size, kv_cache_memory_gib=0.5
        )
        results[size] = measure(config, args.batch, args.new_tokens)
        print(f"{label} TP={size} ({config.threads} threads per shard): {results[size]}")
    one, many = results[1], results[tp]
    return {
        "tp1": one,
        f"tp{tp}": many,
        "batch1_step_ratio": round(many["batch1_ms_per_step"] / one["batch1_ms_per_step"], 3),
        f"batch{args.batch}_throughput_ratio": round(
            many[f"batch{args.batch}_tok_s"] / one[f"batch{args.batch}_tok_s"], 3
        ),
    }


def main() -> None:
    import tempfile

    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        random_model = smollm2_shaped_random(Path(tmp) / "smollm2-shaped")
        out["random_8h_tp2"] = compare(str(random_model), "random 8 heads", 2, args)
    out["smollm2_tp3"] = compare("default", "SmolLM2", 3, args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
