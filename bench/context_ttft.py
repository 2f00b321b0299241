"""Prefix reuse and forked contexts: TTFT behind a 1,000-token shared prefix, one run.

In-process engine, default model and config. Each figure is the median of `--repeats`
runs of "time from submitting the request to its first generated token":
- cold: the 1,000-token prefix + a 24-token question, never seen before;
- cached: a new question behind the same prefix (automatic prefix caching);
- fork: a context forked from a parent that holds the prefix, filled with the question,
  then Generate (Parrot primitives);
- refill: a new context filled with the parent's 1,000 tokens + the question, then
  Generate (what a client without forks has to do; the prefix cache is off for it).
The last line printed is a JSON object with every figure and the ratios.
"""

import argparse
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine import EngineConfig, LLMEngine  # noqa: E402
from app.protocol import SamplingParams  # noqa: E402
from app.protocol.messages import ContextAction, ContextOp  # noqa: E402

ONE = SamplingParams(temperature=0, max_tokens=1)


def first_token_ms(engine: LLMEngine, submit, *args) -> float:  # noqa: ANN001
    """`submit(request_id, *args)`, then step until that request's first token."""
    rid = uuid.uuid4().hex
    start = time.perf_counter()
    submit(rid, *args)
    while True:
        if any(d.request_id == rid and d.token_ids for d in engine.step()):
            elapsed = 1000 * (time.perf_counter() - start)
            while engine.has_work:
                engine.step()
            return elapsed


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--question", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    engine = LLMEngine(EngineConfig(kv_cache_memory_gib=1.0))
    vocab = engine.arch.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    first_token_ms(engine, engine.add_request, tokens(64), ONE)  # warm-up
    figures: dict[str, list[float]] = {"cold": [], "cached": [], "fork": [], "refill": []}
    add = engine.add_request  # (request_id, tokens, params, context=None)
    for i in range(args.repeats):
        prefix = tokens(args.prefix)
        figures["cold"].append(first_token_ms(engine, add, prefix + tokens(24), ONE))
        figures["cached"].append(first_token_ms(engine, add, prefix + tokens(24), ONE))
        parent, child, fresh = f"p{i}", f"c{i}", f"r{i}"
        first_token_ms(engine, add, tokens(args.prefix), ONE, ContextOp(parent, ContextAction.FILL))
        held, q = engine.context_tokens(parent), tokens(args.question)
        fork = ContextOp(child, ContextAction.GENERATE, parent)
        figures["fork"].append(first_token_ms(engine, add, q, ONE, fork))
        engine.block_manager.enable_prefix_caching = False  # a real re-fill: no cache hits
        refill = ContextOp(fresh, ContextAction.GENERATE)
        figures["refill"].append(first_token_ms(engine, add, held + q, ONE, refill))
        engine.block_manager.enable_prefix_caching = True
        for cid in (parent, child, fresh):
            engine.free_context(cid)
    med = {k: round(statistics.median(v), 1) for k, v in figures.items()}
    for k, v in med.items():
        print(f"TTFT {k:7s} {v:8.1f} ms   (runs: {[round(x) for x in figures[k]]})")
    result = {
        "model": engine.source.name,
        "prefix_tokens": args.prefix,
        "ttft_ms": med,
        "cached_speedup": round(med["cold"] / med["cached"], 2),
        "fork_speedup": round(med["refill"] / med["fork"], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
