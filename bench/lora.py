"""Multi-LoRA serving (app/models/lora.py): output tokens per second of 32 streams spread
over 8 adapters, against the same 32 streams on the base model alone, in the same run.

The model: the default SmolLM2-135M-Instruct GGUF as served on a CPU (quantized kernels;
a step of base rows only runs the fused C++ decode layers), in-process. The adapters:
`--adapters` random PEFT LoRA adapters made by peft on the same weights, rank `--rank`
on q, k, v, o, gate, up and down (what fine-tunes usually target), all held at once
(`max_loras`). The workload: `--streams` chat turns at once (continuous batching), the
i-th on adapter i % adapters; greedy, `--max-tokens` each, EOS ignored, so both runs
compute the same number of tokens.

Each round runs both, in alternating order; figures are the best of `--rounds` (the
machine's neighbours only ever slow a run down). The last line printed is a JSON object:
`lora_over_base_32` and the figures behind it.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ASKS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "List ten uses for a paperclip.",
    "Describe the water cycle to a child.",
]


def make_adapters(count: int, rank: int, directory: Path) -> dict[str, str]:
    import functools
    from unittest import mock

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from app.models.source import default_model_path
    from tests.lora_adapters import ATTENTION, MLP, make_adapter

    path = default_model_path()
    name_map = functools.lru_cache(gguf.get_tensor_name_map)  # as tests/conftest.py
    with mock.patch.object(gguf, "get_tensor_name_map", name_map):
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    settings = dict(r=rank, lora_alpha=2 * rank, target_modules=ATTENTION + MLP)
    return {
        f"ft{i}": str(make_adapter(hf, directory / f"ft{i}", i, settings)) for i in range(count)
    }


def tokens_per_s(engine, prompts: list[list[int]], params: list) -> float:  # noqa: ANN001
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    args = parser.parse_args()

    from app.engine import EngineConfig, LLMEngine
    from app.models.source import resolve_model
    from app.protocol.sampling import SamplingParams
    from app.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("default"))
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": ASKS[i % len(ASKS)]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for i in range(args.streams)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        loras = make_adapters(args.adapters, args.rank, Path(tmp))
        config = EngineConfig(
            device="cpu",
            num_threads=args.threads,
            kv_cache_memory_gib=0.5,
            max_loras=args.adapters,
            loras=loras,
        )
        engine = LLMEngine(config)
    names = list(loras)

    def params(lora: bool) -> list[SamplingParams]:
        return [
            SamplingParams(
                temperature=0,
                max_tokens=args.max_tokens,
                ignore_eos=True,
                lora=names[i % len(names)] if lora else None,
            )
            for i in range(args.streams)
        ]

    runs = {"base": params(False), "lora": params(True)}
    for p in runs.values():  # first-use costs (kernel packing, allocator) untimed
        tokens_per_s(engine, prompts[:2], p[:2])
    best = dict.fromkeys(runs, 0.0)
    for r in range(args.rounds):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
            best[name] = max(best[name], tokens_per_s(engine, prompts, runs[name]))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in best.items()), flush=True)
    result = {
        "lora_over_base_32": round(best["lora"] / best["base"], 2),
        "base_tok_s": round(best["base"], 1),
        "lora_tok_s": round(best["lora"], 1),
        "adapters": args.adapters,
        "rank": args.rank,
        "streams": args.streams,
        "threads": args.threads,
    }
    print(
        f"{args.streams} streams over {args.adapters} adapters: {best['lora']:.1f} tok/s, "
        f"the base alone {best['base']:.1f}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
