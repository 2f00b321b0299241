"""Speculative decoding by prompt lookup (app/engine/speculation.py): output tokens per
second with it and without, in the same run, on an input-grounded workload.

The model: the default SmolLM2-135M-Instruct GGUF as served on a CPU (quantized kernels),
in-process, two engines over the same weights (`speculative: {method: ngram}` and off).
The workload: chat turns whose answers copy from their prompts, made from this
repository's own files: repeat a piece of code, rename an identifier in a function,
summarize a document section quoting it, continue a numbered list. Greedy, up to
`--max-tokens` tokens each (also `--temperature`, unseeded: speculative sampling).

- one stream: each prompt alone, one after another;
- 32 streams: the same prompts, repeated to 32 requests, all at once (continuous
  batching); speculation should turn itself off (`max_running`), so the ratio should
  be 1.

Both engines run each round, in alternating order; figures are the best of `--rounds`
(the machine's neighbours only ever slow a run down). The outputs of both engines are
checked equal (greedy). The last line printed is a JSON object: `speedup_1`, `ratio_32` and the
figures behind them.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent


def workload() -> list[str]:
    code = (ROOT / "app" / "engine" / "block_manager.py").read_text()
    func = code[code.index("    def append_slots") : code.index("    def _needs_copy")]
    design = (ROOT / "docs" / "design.md").read_text()
    section = design[design.index("## Engine design") :][:1800]
    sched = (ROOT / "app" / "engine" / "scheduler.py").read_text()[:1600]
    return [
        f"Repeat this code exactly, with no comment:\n\n{sched}",
        f"Rename `seq` to `sequence` in this function and show the whole function:\n\n{func}",
        f"Summarize this text in five sentences, quoting it where you can:\n\n{section}",
        "Continue this list up to 40:\n1. apple\n2. apple pie\n3. apple tart\n4. apple juice\n",
    ]


def engines(threads: int, num_tokens: int):  # noqa: ANN201
    from app.engine import EngineConfig, LLMEngine
    from app.engine.config import SpeculativeConfig

    def config(**extra) -> EngineConfig:  # noqa: ANN003
        return EngineConfig(device="cpu", num_threads=threads, kv_cache_memory_gib=0.5, **extra)

    plain = LLMEngine(config())
    spec = LLMEngine(
        config(speculative=SpeculativeConfig(num_tokens=num_tokens)), loaded=plain.loaded
    )
    return plain, spec


def tokens_per_s(engine, prompts: list[list[int]], params, together: bool) -> tuple[float, list]:  # noqa: ANN001
    started = time.perf_counter()
    if together:
        outputs = engine.generate(prompts, params)
    else:
        outputs = [engine.generate([p], params)[0] for p in prompts]
    elapsed = time.perf_counter() - started
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    return sum(len(i) for i in ids) / elapsed, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--num-tokens", type=int, default=4, help="tokens proposed a step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    from app.models.source import resolve_model
    from app.protocol.sampling import SamplingParams
    from app.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("default"))
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for text in workload()
    ]
    many = [prompts[i % len(prompts)] for i in range(args.streams)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    plain, spec = engines(args.threads, args.num_tokens)
    for engine in (plain, spec):  # first-use costs (kernel packing, allocator) untimed
        tokens_per_s(engine, prompts[:1], params, False)
    best = {"plain_1": 0.0, "spec_1": 0.0, "plain_32": 0.0, "spec_32": 0.0}
    for r in range(args.rounds):
        order = [("plain", plain), ("spec", spec)][:: 1 if r % 2 == 0 else -1]
        outputs = {}
        for label, batch, together in (("1", prompts, False), ("32", many, True)):
            for name, engine in order:
                rate, ids = tokens_per_s(engine, batch, params, together)
                best[f"{name}_{label}"] = max(best[f"{name}_{label}"], rate)
                outputs[(name, label)] = ids
            if args.temperature == 0 and outputs[("plain", label)] != outputs[("spec", label)]:
                sys.exit(f"the outputs differ with speculation ({label} streams)")
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in best.items()), flush=True)
    stats = spec.stats_snapshot()
    proposed = stats["spec_draft_tokens"]
    result = {
        "speedup_1": round(best["spec_1"] / best["plain_1"], 2),
        "ratio_32": round(best["spec_32"] / best["plain_32"], 2),
        **{f"{k}_tok_s": round(v, 1) for k, v in best.items()},
        "acceptance": round(stats["spec_accepted_tokens"] / proposed, 3) if proposed else 0.0,
        "tokens_per_verifying_step": round(
            1 + stats["spec_accepted_tokens"] / max(stats["spec_proposals"], 1), 2
        ),
        "num_tokens": args.num_tokens,
        "temperature": args.temperature,
        "threads": args.threads,
    }
    print(f"one stream: {best['spec_1']:.1f} against {best['plain_1']:.1f} tok/s")
    print(f"{args.streams} streams: {best['spec_32']:.1f} against {best['plain_32']:.1f} tok/s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
