"""Warm state that outlives the KV cache: returning contexts' TTFT with the second KV tier
(app/engine/kv_tier.py) against without it, in one run.

In-process engine, the default model and engine config but for the KV cache, sized so
that the contexts hold `--overcommit` times what it can: `--contexts` persistent
contexts, each filled with `--tokens` tokens, then `--turns` rounds in which every
context in turn gets a short new message and generates a few tokens (round-robin, the
order that evicts the most). A returning context's TTFT (submit to first token) is what
it costs to get its history back: read from the tier (on: a file on the local disk, as
on a CPU replica), or computed again from the prefix cache's leftovers (off). Both
engines run in this process one after the other; their tokens must agree.

Printed: per setting the mean and p50 TTFT of returning turns, tokens computed and
read back; then the gain. The last line is a JSON object with `tier_ttft_gain` (off /
on, mean) and the issue's other keys, `moved_over_unmoved_ttft` and
`recompute_over_moved_ttft`, null: contexts do not move between replicas yet.

    .venv/bin/python bench/warm_state.py [--contexts 16 --tokens 1024 --turns 3]
"""

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine import EngineConfig, LLMEngine  # noqa: E402
from app.models.attention_backends import select_backend  # noqa: E402
from app.models.loader import random_model  # noqa: E402
from app.protocol import SamplingParams  # noqa: E402
from app.protocol.messages import ContextAction, ContextOp  # noqa: E402
from bench.gpu_decode import SHAPES, write_config  # noqa: E402

NEW_TOKENS = 8  # a returning turn's own message
REPLY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def turn(engine: LLMEngine, cid: str, tokens: list[int]) -> tuple[float, list[int]]:
    """One Generate on context `cid`: ms to its first token, and its tokens."""
    rid = uuid.uuid4().hex
    started = time.perf_counter()
    engine.add_request(rid, tokens, REPLY, ContextOp(cid, ContextAction.GENERATE))
    first, out = None, []
    while engine.has_work:
        for d in engine.step():
            if d.request_id == rid and d.token_ids:
                first = first or 1000 * (time.perf_counter() - started)
                out += d.token_ids
    assert first is not None
    return first, out


def run(args: argparse.Namespace, offload: str, threads: int) -> dict:
    block = 16
    per_context = args.tokens + (args.turns + 1) * (NEW_TOKENS + REPLY.max_tokens) + block
    blocks = (args.contexts * per_context) // (args.overcommit * block)
    config = EngineConfig(
        num_kv_blocks=blocks,
        kv_offload=offload,
        kv_offload_gib=args.tier_gib,
        max_num_batched_tokens=2048,
        num_threads=threads,
    )
    loaded = None
    if args.shape:  # random weights of a real shape, drawn on the device (GPU machine)
        source = write_config(args.shape, args.root)
        config = config.model_copy(
            update=dict(
                model=str(source.directory),
                device=args.device,
                dtype=args.dtype,
                max_model_len=per_context + 64,
            )
        )
        backend = select_backend(config.attention_backend, config.torch_device, block)
        loaded = random_model(
            source, backend, config.torch_dtype, config.torch_device, config.max_model_len
        )
    engine = LLMEngine(config, loaded=loaded)
    rng = random.Random(0)
    histories = {
        f"c{i}": [rng.randrange(1000, args.vocab) for _ in range(args.tokens)]
        for i in range(args.contexts)
    }
    for cid, tokens in histories.items():
        turn(engine, cid, tokens)
    ttfts, outputs = [], []
    for round_ in range(args.turns + 1):
        if round_ == 1:
            before = engine.stats_snapshot()
        for cid in histories:
            ms, out = turn(
                engine, cid, [rng.randrange(1000, args.vocab) for _ in range(NEW_TOKENS)]
            )
            outputs.append(out)
            if round_:  # the first round is not timed: it compiles (GPU) a short query
                ttfts.append(ms)  # on a long context, a shape the filling never ran
    after = engine.stats_snapshot()
    del engine, loaded
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next setting's cache and weights
    return {
        "kv_offload": offload,
        "cache_blocks": blocks,
        "mean_ttft_ms": round(statistics.mean(ttfts), 1),
        "p50_ttft_ms": round(statistics.median(ttfts), 1),
        "computed_tokens": after["num_prompt_tokens"] - before["num_prompt_tokens"],
        "tier_tokens": after["kv_tier_hit_tokens"] - before["kv_tier_hit_tokens"],
        "tier_read_s": round(after["kv_tier_read_s"], 3),
        "tier_write_s": round(after["kv_tier_write_s"], 3),
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024, help="each context's history")
    parser.add_argument("--turns", type=int, default=3, help="returning turns per context")
    parser.add_argument("--overcommit", type=int, default=4, help="contexts' KV / cache")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (all cores)")
    parser.add_argument("--tier-gib", type=float, default=4.0, help="kv_offload_gib")
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), help="random weights of this shape (default: the model)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    args.vocab = SHAPES[args.shape]["vocab_size"] if args.shape else 40000
    import os

    threads = args.threads or os.cpu_count() or 1
    # the tier a replica of this device gets: RAM beside a GPU, the disk beside a CPU cache
    on = "memory" if args.shape and args.device.startswith("cuda") else "disk"
    results = {}
    with tempfile.TemporaryDirectory() as root:
        args.root = Path(root)
        for offload in (on, "off"):
            results[offload] = run(args, offload, threads)
            r = results[offload]
            print(
                f"kv_offload={offload:<6} cache {r['cache_blocks']} blocks: returning TTFT mean "
                f"{r['mean_ttft_ms']} ms, p50 {r['p50_ttft_ms']} ms; computed "
                f"{r['computed_tokens']} tokens, read back {r['tier_tokens']} (read "
                f"{r['tier_read_s']} s, write {r['tier_write_s']} s)",
                flush=True,
            )
    same = results[on].pop("outputs") == results["off"].pop("outputs")
    gain = results["off"]["mean_ttft_ms"] / results[on]["mean_ttft_ms"]
    print(f"tier gain (mean TTFT off / on): {gain:.2f}x; same tokens: {same}")
    print(
        json.dumps(
            {
                "shape": args.shape or "default model",
                "device": args.device if args.shape else "cpu",
                "contexts": args.contexts,
                "tokens": args.tokens,
                "overcommit": args.overcommit,
                "tier_ttft_gain": round(gain, 2),
                "same_tokens": same,
                "moved_over_unmoved_ttft": None,
                "recompute_over_moved_ttft": None,
                "settings": results,
            }
        )
    )


if __name__ == "__main__":
    main()
