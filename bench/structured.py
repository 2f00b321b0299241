"""Structured outputs: engine throughput at N streams with every request under a JSON
schema, against the same requests unconstrained, in one run on one engine.

Both sides run the default model with the default engine config, the same N chat
prompts, greedy, exactly `--tokens` output tokens each: the schema asks for an array of
at least 256 strings, so no constrained output ends before its budget, and the
unconstrained side ignores EOS. The sides alternate `--rounds` times; medians are
reported. Per step: how long the grammar masks took on their worker thread (overlapped
with the forward) against the step itself.

    .venv/bin/python bench/structured.py [--streams 32] [--tokens 128] [--rounds 3]

The last line printed is a JSON object with every figure.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "facts": {"type": "array", "items": {"type": "string"}, "minItems": 256},
    },
    "required": ["topic", "facts"],
    "additionalProperties": False,
}
TOPICS = [
    "tides", "printing presses", "the sky", "compilers", "chess", "photosynthesis",
    "vaccines", "the water cycle", "hash tables", "the French Revolution", "airplanes",
    "stars", "volcanoes", "bees", "the moon", "glaciers",
]  # fmt: skip


def prompts(tokenizer, n: int) -> list[list[int]]:  # noqa: ANN001
    from app.text.tokenizer import chat_token_ids

    out = []
    for i in range(n):
        ask = f"List facts about {TOPICS[i % len(TOPICS)]} as JSON. (request {i})"
        out.append(chat_token_ids(tokenizer, [{"role": "user", "content": ask}]))
    return out


def run_side(engine, ids: list[list[int]], params) -> dict:  # noqa: ANN001
    before = engine.stats_snapshot()
    started = time.perf_counter()
    results = engine.generate(ids, params)
    wall = time.perf_counter() - started
    after = engine.stats_snapshot()
    tokens = sum(len(o.token_ids) for r in results for o in r.outputs)
    steps = after["num_steps"] - before["num_steps"]
    mask_steps = after["grammar_mask_steps"] - before["grammar_mask_steps"]
    mask_s = after["grammar_mask_s"] - before["grammar_mask_s"]
    return {
        "tok_s": tokens / wall,
        "tokens": tokens,
        "step_ms": 1e3 * wall / max(steps, 1),
        "mask_ms": 1e3 * mask_s / mask_steps if mask_steps else 0.0,
        "texts": [results[0].outputs[0].token_ids],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from app.engine import LLMEngine
    from app.engine.config import EngineConfig
    from app.models.source import resolve_model
    from app.protocol.sampling import Constraint, SamplingParams
    from app.text.tokenizer import load_tokenizer

    engine = LLMEngine(EngineConfig(max_num_seqs=max(args.streams, 32)))
    tokenizer = load_tokenizer(resolve_model(engine.config.model))
    ids = prompts(tokenizer, args.streams)
    constraint = Constraint(kind="json", spec=json.dumps(SCHEMA))
    sides = {
        "unconstrained": SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True),
        "json_schema": SamplingParams(
            max_tokens=args.tokens, temperature=0, ignore_eos=True, constraint=constraint
        ),
    }
    for params in sides.values():  # warm-up: kernels, the grammar's lexer
        engine.generate(ids[:2], params.model_copy(update={"max_tokens": 8}))
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, params in sides.items():
            runs[name].append(run_side(engine, ids, params))

    sample = tokenizer.decode(runs["json_schema"][-1]["texts"][0])
    print(f"{args.streams} streams x {args.tokens} tokens, greedy, {args.rounds} rounds (medians)")
    print(f"a constrained output starts: {sample[:100]!r}")
    figures = {}
    for name, rs in runs.items():
        f = {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "step_ms", "mask_ms")}
        figures[name] = f
        print(
            f"{name:>14}: {f['tok_s']:7.1f} tok/s  step {f['step_ms']:6.1f} ms"
            f"  mask {f['mask_ms']:.3f} ms/step"
        )
    ratio = figures["json_schema"]["tok_s"] / figures["unconstrained"]["tok_s"]
    share = figures["json_schema"]["mask_ms"] / figures["json_schema"]["step_ms"]
    print(f"json_schema / unconstrained throughput: {ratio:.3f} (target >= 0.90)")
    print(f"mask time / step time: {100 * share:.2f} % (computed while the model runs)")
    print(json.dumps({"streams": args.streams, "tokens": args.tokens, **figures, "ratio": ratio}))


if __name__ == "__main__":
    main()
