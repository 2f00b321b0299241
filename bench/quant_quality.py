"""What keeping a GGUF's quantized weights costs in quality, against the same file
dequantized to bfloat16, with llama.cpp's figure on the same file beside them.

- Perplexity over a fixed text (bench/data/lighthouses.txt, written for this bench) in
  windows of `--ctx` tokens, scoring the second half of each window as llama-perplexity
  does (each scored token then sees at least ctx/2 tokens of context). llama-perplexity
  runs with the same window when its binary is found (`--llama-cpp DIR` or
  $SHOAL_LLAMA_CPP, bench/llama_cpp_peer.py).
- Greedy agreement over a fixed set of chat prompts: how many answers of `--tokens`
  tokens are identical, and how long the common prefix is, for the quantized model
  against the bfloat16 one, and for each against the float32 dequantized model (bfloat16
  arithmetic alone moves greedy output; this puts the quantized model's drift beside it),
  and for the quantized model's float16 KV cache (kv_cache_dtype 'auto' on AVX-512 or AVX2) and
  a bfloat16 one against a float32 one.

All sides are Shoal's engine on the same file: `quantization` auto (the file's blocks and
our kernels) against `none` in bfloat16 and in float32. The last line printed is a JSON
object.
"""

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp_peer as llama_cpp  # noqa: E402

from app.engine import EngineConfig, LLMEngine  # noqa: E402
from app.protocol import SamplingParams  # noqa: E402
from app.text.tokenizer import chat_token_ids, load_tokenizer  # noqa: E402

TEXT = Path(__file__).with_name("data") / "lighthouses.txt"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain how a refrigerator keeps food cold.",
    "List three uses of a paperclip.",
    "Why do leaves change color in autumn?",
    "Give me a recipe for pancakes.",
    "What is 17 times 23?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I reverse a list in Python?",
    "What causes thunder?",
    "Describe a cat to someone who has never seen one.",
    "What are the planets of the solar system?",
    "Translate 'good morning' into Spanish and German.",
    "Why is exercise good for health?",
    "What is the difference between weather and climate?",
    "Tell me a short story about a lighthouse keeper.",
]


def engine_for(
    model: str, quantization: str, dtype: str, kv_cache_dtype: str, threads: int
) -> LLMEngine:
    config = EngineConfig(
        model=model,
        quantization=quantization,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        num_threads=threads,
        kv_cache_memory_gib=0.5,
        enable_prefix_caching=False,
    )
    return LLMEngine(config)


def perplexity(engine: LLMEngine, ids: list[int], ctx: int) -> tuple[float, int]:
    """exp(mean NLL) of the second half of each ctx-token window, and how many scored: as
    llama-perplexity, the logits at positions first .. ctx-2 (first = ctx / 2) predict
    the tokens after them."""
    if len(ids) < ctx:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {ctx}")
    model = engine.runner.model
    first = ctx // 2
    hidden: list[torch.Tensor] = []
    hook = model.model.register_forward_hook(lambda m, a, out: hidden.append(out.detach()))
    nll, scored = 0.0, 0
    try:
        for start in range(0, len(ids) - ctx + 1, ctx):
            window = ids[start : start + ctx]
            hidden.clear()
            engine.generate([window], SamplingParams(temperature=0, max_tokens=1))
            h = torch.cat(hidden)[: len(window)]  # the prefill chunks, in order
            assert h.shape[0] == len(window), "the window must be one prefill"
            with torch.inference_mode():
                logits = model.lm_head(h[first:-1]).float()[:, : engine.arch.vocab_size]
            if engine.arch.final_softcap:  # Gemma 2, as DecoderForCausalLM.forward does
                cap = engine.arch.final_softcap
                logits = torch.tanh(logits / cap) * cap
            targets = torch.tensor(window[first + 1 :], device=logits.device)
            nll -= float(torch.log_softmax(logits, -1).gather(1, targets[:, None]).sum())
            scored += len(targets)
    finally:
        hook.remove()
    return math.exp(nll / scored), scored


def greedy(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in engine.generate(prompts, params)]


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Identical answers, and the mean length of the common prefix in tokens."""
    pairs = list(zip(ours, theirs, strict=True))
    prefixes = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        for x, y in pairs
    ]
    return {
        "identical": f"{sum(x == y for x, y in pairs)}/{len(pairs)}",
        "mean_common_prefix": round(sum(prefixes) / len(prefixes), 1),
    }


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--llama-cpp", default=None, help="directory of llama.cpp's binaries")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    result: dict = {"ctx": args.ctx, "greedy_tokens": args.tokens}
    outputs = {}
    for label, quantization, dtype, kv_dtype in (
        ("quantized", "gguf", "auto", "auto"),  # gguf: fail rather than dequantize quietly
        ("quantized_f32_kv", "gguf", "auto", "float32"),  # what the float16 cache costs
        ("quantized_bf16_kv", "gguf", "auto", "bfloat16"),
        ("bfloat16", "none", "bfloat16", "auto"),
        ("float32", "none", "float32", "auto"),
    ):
        engine = engine_for(args.model, quantization, dtype, kv_dtype, args.threads)
        tokenizer = load_tokenizer(engine.source)
        ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
        ppl, scored = perplexity(engine, ids, args.ctx)
        prompts = [chat_token_ids(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
        outputs[label] = greedy(engine, prompts, args.tokens)
        result[f"ppl_{label}"] = round(ppl, 3)
        result["scored_tokens"] = scored
        print(
            f"{label:16} ({engine.config.quantization}, {engine.runner.dtype}, "
            f"{engine.runner.kv_dtype} cache): "
            f"perplexity {ppl:.3f} over {scored} tokens"
        )
        source = engine.source
        del engine

    pairs = [
        ("quantized", "quantized_f32_kv"),
        ("quantized_bf16_kv", "quantized_f32_kv"),
        ("quantized", "bfloat16"),
        ("quantized", "float32"),
        ("bfloat16", "float32"),
    ]
    for a, b in pairs:
        result[f"greedy_{a}_vs_{b}"] = agreement(outputs[a], outputs[b])
        print(f"greedy, {a} against {b}: {result[f'greedy_{a}_vs_{b}']}")

    binary = llama_cpp.find("llama-perplexity", args.llama_cpp)
    if binary and source.is_gguf:
        path = str(source.directory / source.gguf_file)
        try:
            ppl = llama_cpp.perplexity(binary, path, str(TEXT), args.threads, args.ctx)
        except (RuntimeError, subprocess.SubprocessError) as exc:  # e.g. text < 2 windows
            print(f"llama-perplexity failed: {exc}")
        else:
            result["ppl_llama_cpp"] = ppl
            print(f"llama.cpp  (llama-perplexity, same file): perplexity {ppl:.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
