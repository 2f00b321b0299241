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

Then contexts that move (deployments/context_moves.py, in-process: the object store's
hop is left out): `--move-contexts` contexts of `--tokens` tokens are built over 9 turns
on one engine (the drained replica) and saved in the slot-file format (at the drain,
untimed); the 10th turn's TTFT is timed three ways: there (unmoved), on a second engine
after restoring the file (moved: the restore is in the time), and on a third from the
whole history (recompute, what a context that cannot move costs). All three must give
the same tokens.

Printed: per setting the mean and p50 TTFT of returning turns, tokens computed and
read back; then the gain; then the moves. The last line is a JSON object with
`tier_ttft_gain` (off / on, mean), `moved_over_unmoved_ttft` and
`recompute_over_moved_ttft` (means).

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


def move_figures(args: argparse.Namespace, threads: int) -> dict:
    from app.engine.context_files import ContextFiles

    rng = random.Random(1)
    config = EngineConfig(max_num_batched_tokens=2048, num_threads=threads)
    ids = [f"m{i}" for i in range(args.move_contexts)]
    turns = {  # ten messages each, the first carrying the history
        c: [[rng.randrange(1000, args.vocab) for _ in range(args.tokens)]]
        + [[rng.randrange(1000, args.vocab) for _ in range(NEW_TOKENS)] for _ in range(9)]
        for c in ids
    }
    timed: dict[str, list[float]] = {"unmoved": [], "moved": [], "recompute": []}
    outputs: dict[str, list[list[int]]] = {k: [] for k in timed}
    history: dict[str, list[int]] = {c: [] for c in ids}

    def warm(engine: LLMEngine) -> None:  # first-call costs out of the figures
        turn(engine, "warm-up", [rng.randrange(1000, args.vocab) for _ in range(64)])
        turn(engine, "warm-up", [rng.randrange(1000, args.vocab) for _ in range(NEW_TOKENS)])

    with tempfile.TemporaryDirectory() as directory:
        drained = LLMEngine(config)
        warm(drained)
        for c in ids:
            for message in turns[c][:9]:
                _, out = turn(drained, c, message)
                history[c] += message + out
            ContextFiles(drained).save(c, f"{directory}/{c}.slot")  # at the drain
        for c in ids:
            ms, out = turn(drained, c, turns[c][9])
            timed["unmoved"].append(ms)
            outputs["unmoved"].append(out)
        del drained
        gc.collect()
        survivor = LLMEngine(config)
        warm(survivor)
        files = ContextFiles(survivor)
        for c in ids:
            started = time.perf_counter()
            files.restore(c, f"{directory}/{c}.slot")
            restore_ms = 1000 * (time.perf_counter() - started)
            ms, out = turn(survivor, c, turns[c][9])
            timed["moved"].append(restore_ms + ms)
            outputs["moved"].append(out)
        del survivor, files
        gc.collect()
    fresh = LLMEngine(config)
    warm(fresh)
    for c in ids:
        ms, out = turn(fresh, f"again-{c}", history[c] + turns[c][9])
        timed["recompute"].append(ms)
        outputs["recompute"].append(out)
    del fresh
    gc.collect()
    means = {k: round(statistics.mean(v), 1) for k, v in timed.items()}
    return {
        "contexts": len(ids),
        "history_tokens": round(statistics.mean(len(h) for h in history.values())),
        "mean_ttft_ms": means,
        "same_tokens": outputs["unmoved"] == outputs["moved"] == outputs["recompute"],
        "moved_over_unmoved_ttft": round(means["moved"] / means["unmoved"], 2),
        "recompute_over_moved_ttft": round(means["recompute"] / means["moved"], 2),
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
    parser.add_argument("--move-contexts", type=int, default=8, help="0: no move figures")
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
    moves = None
    if args.move_contexts and not args.shape:  # the default model: what a replica serves
        moves = move_figures(args, threads)
        t = moves["mean_ttft_ms"]
        print(
            f"10th turn of {moves['contexts']} contexts of ~{moves['history_tokens']} tokens: "
            f"unmoved {t['unmoved']} ms, moved {t['moved']} ms (restore included), "
            f"recomputed {t['recompute']} ms; moved/unmoved "
            f"{moves['moved_over_unmoved_ttft']}x, recompute/moved "
            f"{moves['recompute_over_moved_ttft']}x; same tokens: {moves['same_tokens']}",
            flush=True,
        )
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
                "moved_over_unmoved_ttft": moves and moves["moved_over_unmoved_ttft"],
                "recompute_over_moved_ttft": moves and moves["recompute_over_moved_ttft"],
                "settings": results,
                "moves": moves,
            }
        )
    )


if __name__ == "__main__":
    main()
