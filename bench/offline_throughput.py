"""Offline throughput: Shoal's engine against transformers' `generate`, one process, one run.

Workload (fixed seed): 128 requests, prompt lengths uniform in [16, 512], output lengths
uniform in [16, 256] with EOS ignored. Shoal takes them all at once (continuous
batching); transformers runs static batches of 16 in arrival order with left padding,
each batch generating until its longest request is done (only requested tokens count).
Both use the same dtype and thread count; Shoal runs its default `quantization` (a
GGUF's blocks kept, where transformers gets the dequantized weights) unless
`--quantization none`. Also measured: single-stream decode ms/token
(32-token prompt, 128 new tokens), TTFT of a 512-token prompt, and peak throughput with
128 concurrent sequences (128-token prompts, 128 new tokens).

For a GGUF model, llama.cpp's own figures on the same file run in the same invocation
when its binaries are found (`--llama-cpp DIR` or $SHOAL_LLAMA_CPP, see bench/llama_cpp_peer.py):
llama-bench's decode ms/token and 512-token prompt time, beside Shoal's single-stream
decode and TTFT(512). The weights' bytes, and the floor they set on a decode step (those
bytes over this machine's measured read bandwidth), are printed too.

`--arch FAMILY` (or `all`) runs the same comparison on a random checkpoint of each model
family (tests/models/family_checkpoints.py) in its tiny test shape and in a realistic
~100M-parameter shape (`--shape`), written to a temporary directory: no downloads.

The last line printed is a JSON object with every figure (a list of them with --arch).
"""

import argparse
import json
import os
import random
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_cpp_peer as llama_cpp  # noqa: E402

from app.engine import EngineConfig, LLMEngine  # noqa: E402
from app.protocol import SamplingParams  # noqa: E402


def make_workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        prompt_len = rng.randint(16, 512)
        out_len = rng.randint(16, 256)
        work.append(([rng.randrange(100, vocab) for _ in range(prompt_len)], out_len))
    return work


def shoal_offline(engine: LLMEngine, work: list[tuple[list[int], int]]) -> tuple[float, int]:
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    start = time.perf_counter()
    outs = engine.generate([p for p, _ in work], params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def shoal_single_stream(engine: LLMEngine, vocab: int) -> tuple[float, float]:
    """(decode ms/token, TTFT ms of a 512-token prompt)."""
    rng = random.Random(1)
    engine.add_request(
        "s",
        [rng.randrange(100, vocab) for _ in range(32)],
        SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
    )
    engine.step()
    start = time.perf_counter()
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    decode_ms = (time.perf_counter() - start) * 1000 / steps
    ttfts = []
    for _ in range(3):
        prompt = [rng.randrange(100, vocab) for _ in range(512)]  # fresh: no prefix hit
        rid = uuid.uuid4().hex
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1))
        start = time.perf_counter()
        while not engine.step():
            pass
        ttfts.append((time.perf_counter() - start) * 1000)
        while engine.has_work:
            engine.step()
    return decode_ms, min(ttfts)


def shoal_peak(engine: LLMEngine, vocab: int) -> float:
    rng = random.Random(2)
    prompts = [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(128)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def hf_static(
    model, work: list[tuple[list[int], int]], pad_id: int, batch: int
) -> tuple[float, int]:
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, (p, _) in enumerate(chunk):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(o for _, o in chunk)
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
            )
        useful += sum(o for _, o in chunk)
    return time.perf_counter() - start, useful


def hf_single_stream(model, vocab: int) -> float:
    rng = random.Random(1)
    ids = torch.tensor([[rng.randrange(100, vocab) for _ in range(32)]])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=129, min_new_tokens=129, do_sample=False)
        t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) * 1000 / 128


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: parameters and buffers (RoPE tables aside),
    quantized weights at their packed size."""
    from app.models.quantized_model import quantized_bytes

    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if t.dim() >= 2}
    rope = {id(b) for name, b in model.named_buffers() if "rotary" in name}
    plain = sum(t.numel() * t.element_size() for i, t in tensors.items() if i not in rope)
    return plain + quantized_bytes(model)


def read_bandwidth() -> float:
    """Bytes/s a full-thread sum over 256 MB reads (best of 5): the bound on a
    weight-streaming decode step."""
    x = torch.ones(64 << 20)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * x.element_size() / best


def load_transformers_dense(model: str, dtype: torch.dtype):
    """transformers' own model, dense, in `dtype`. For a GGUF file transformers would keep
    the weights quantized and compute through its own kernels; for a like-for-like
    baseline we build its dense model and hand it the dequantized weights."""
    from transformers import AutoModelForCausalLM

    from app.models.families import read_arch_config
    from app.models.loader import load_hf_config
    from app.models.source import resolve_model
    from app.models.weights import iter_weights

    source = resolve_model(model)
    if not source.is_gguf:
        return AutoModelForCausalLM.from_pretrained(str(source.directory), dtype=dtype).eval()
    config = load_hf_config(source)
    hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = dict(iter_weights(source, read_arch_config(config, source.name)))
    missing, unexpected = hf.load_state_dict(fused_experts(state, hf), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    return hf.eval()


def fused_experts(state: dict, model: torch.nn.Module) -> dict:
    """Per-expert tensors (experts.E.gate_proj...) as the stacked parameters transformers'
    own MoE layers hold where it has them (experts.gate_up_proj: (E, 2I, H), gate
    first; experts.down_proj: (E, H, I))."""
    import re

    expert = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    fused = {name for name, _ in model.named_parameters() if name.endswith(".gate_up_proj")}
    out, groups = {}, {}
    for name, tensor in state.items():
        found = expert.match(name)
        if found and f"{found.group(1)}.gate_up_proj" in fused:
            groups.setdefault(found.group(1), {})[(int(found.group(2)), found.group(3))] = tensor
        else:
            out[name] = tensor
    for prefix, parts in groups.items():
        experts = range(1 + max(e for e, _ in parts))
        gate_up = [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in experts]
        out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down")] for e in experts])
    return out


# A realistic small shape (~100M parameters with a 32k vocabulary) for every family;
# windows of 256 so the workload's prompts (up to 512 tokens) cross them.
REALISTIC = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    initializer_range=0.02,
    eos_token_id=2,
)
REALISTIC_BY_FAMILY = {
    "mistral-window": dict(sliding_window=256),
    "gemma2": dict(sliding_window=256, num_hidden_layers=8),
    "gemma3": dict(
        sliding_window=256,
        layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2,
    ),
    "phi4-mini": dict(max_position_embeddings=4096),
    "mixtral": dict(num_local_experts=8, intermediate_size=352),
    "qwen2-moe": dict(
        num_experts=8, moe_intermediate_size=352, shared_expert_intermediate_size=1408
    ),
    "qwen3-moe": dict(num_experts=8, moe_intermediate_size=352),
}


def family_checkpoint(family: str, shape: str, root: Path) -> Path:
    from tests.models.family_checkpoints import save_family_checkpoint

    overrides: dict = {"max_position_embeddings": 1024}  # the workload's 512 + 256 tokens fit
    if shape == "realistic":
        overrides = {**REALISTIC, **REALISTIC_BY_FAMILY.get(family, {})}
        if family.startswith("phi"):
            overrides.pop("head_dim")  # Phi-3 derives it from hidden / heads
    return save_family_checkpoint(root / f"{family}-{shape}", family, **overrides)


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--arch", help="a family of tests/models/family_checkpoints.py, or all")
    parser.add_argument("--shape", default="both", choices=["tiny", "realistic", "both"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--skip-hf", action="store_true", help="only Shoal's figures")
    parser.add_argument("--quantization", default=None, help="EngineConfig.quantization")
    parser.add_argument("--llama-cpp", default=None, help="directory of llama.cpp's binaries")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.arch:
        print(json.dumps(run(args.model, args)))
        return
    import tempfile

    from tests.models.family_checkpoints import FAMILIES

    families = sorted(FAMILIES) if args.arch == "all" else [args.arch]
    shapes = ["tiny", "realistic"] if args.shape == "both" else [args.shape]
    results = []
    with tempfile.TemporaryDirectory() as root:
        for family in families:
            for shape in shapes:
                path = family_checkpoint(family, shape, Path(root))
                print(f"== {family} ({shape})")
                results.append({"arch": family, "shape": shape, **run(str(path), args)})
    print(f"{'arch':16} {'shape':9} {'shoal tok/s':>11} {'hf tok/s':>9} {'ratio':>6}")
    for r in results:
        print(
            f"{r['arch']:16} {r['shape']:9} {r['shoal_tok_s']:11.1f} "
            f"{r.get('hf_tok_s', float('nan')):9.1f} {r.get('ratio', float('nan')):6.2f}"
        )
    print(json.dumps(results))


def run(model: str, args: argparse.Namespace) -> dict:
    bandwidth = read_bandwidth()  # before the engine: measured after it, it read half as fast
    quant = {"quantization": args.quantization} if args.quantization else {}
    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype=args.dtype,
            num_threads=args.threads,
            kv_cache_memory_gib=2.0,
            **quant,
        )
    )
    dtype = engine.runner.dtype
    vocab = engine.arch.vocab_size
    weight_bytes = model_weight_bytes(engine.runner.model)
    floor_ms = 1000 * weight_bytes / bandwidth
    print(
        f"model {engine.source.name}  dtype {dtype}  quantization {engine.config.quantization}  "
        f"KV cache {engine.runner.kv_dtype}  threads {args.threads}  KV blocks {engine.block_manager.num_blocks}x"
        f"{engine.config.block_size}\nweights {weight_bytes / 1e6:.1f} MB: decode floor "
        f"{floor_ms:.2f} ms/token at this machine's read bandwidth"
    )
    work = make_workload(args.requests, vocab, seed=0)
    engine.generate([work[0][0]], SamplingParams(max_tokens=4))  # warm-up

    shoal_s, shoal_tokens = shoal_offline(engine, work)
    shoal_tok_s = shoal_tokens / shoal_s
    print(
        f"shoal   offline: {shoal_tokens} tokens in {shoal_s:.1f}s = {shoal_tok_s:.1f} tok/s "
        f"(preemptions {engine.stats.num_preemptions})"
    )
    single_ms, ttft_ms = shoal_single_stream(engine, vocab)
    print(f"shoal   single-stream decode: {single_ms:.1f} ms/token   TTFT(512): {ttft_ms:.0f} ms")
    peak = shoal_peak(engine, vocab)
    print(f"shoal   peak (128 x 128->128): {peak:.1f} tok/s")

    result = {
        "model": engine.source.name,
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": engine.config.quantization,
        "kv_cache_dtype": str(engine.runner.kv_dtype).removeprefix("torch."),
        "threads": args.threads,
        "weights_mb": round(weight_bytes / 1e6, 1),
        "floor_ms": round(floor_ms, 2),
        "shoal_tok_s": round(shoal_tok_s, 1),
        "single_stream_ms": round(single_ms, 2),
        "ttft_512_ms": round(ttft_ms, 1),
        "peak_tok_s": round(peak, 1),
    }
    llama_bench = llama_cpp.find("llama-bench", args.llama_cpp)
    if engine.source.is_gguf and llama_bench:
        path = str(engine.source.directory / engine.source.gguf_file)
        peer = llama_cpp.llama_bench(llama_bench, path, args.threads)
        print(
            f"llama.cpp (llama-bench, same file): decode {peer['decode_ms']:.1f} ms/token  "
            f"prompt(512) {peer['prompt_512_ms']:.0f} ms"
        )
        result.update(
            llama_cpp_decode_ms=peer["decode_ms"],
            llama_cpp_prompt_512_ms=peer["prompt_512_ms"],
            decode_vs_llama_cpp=round(peer["decode_ms"] / single_ms, 2),
        )
    if not args.skip_hf:
        del engine
        hf = load_transformers_dense(model, dtype)
        hf_s, hf_tokens = hf_static(hf, work, pad_id=0, batch=args.hf_batch)
        hf_tok_s = hf_tokens / hf_s
        print(
            f"hf      static batches of {args.hf_batch}: {hf_tokens} tokens in {hf_s:.1f}s = {hf_tok_s:.1f} tok/s"
        )
        hf_ms = hf_single_stream(hf, vocab)
        print(f"hf      single-stream decode: {hf_ms:.1f} ms/token")
        result.update(
            hf_tok_s=round(hf_tok_s, 1),
            ratio=round(shoal_tok_s / hf_tok_s, 2),
            hf_single_stream_ms=round(hf_ms, 2),
        )
        print(f"ratio (shoal / transformers): {result['ratio']:.2f}x")
    return result


if __name__ == "__main__":
    main()
