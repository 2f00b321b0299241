"""Decode on the device, against the bandwidth floor and transformers' `generate`.

For each shape (random weights drawn on the device: real 8B weights cannot be carried
to the GPU machine), with Shoal's engine driven directly (no Ray, no HTTP):
- batch-1 decode step time, beside the bandwidth floor: the bytes one step must read
  (every weight once, plus the KV cache of the context) over the copy bandwidth
  measured here;
- throughput (generated tokens/s) at each concurrency: that many sequences of
  PROMPT tokens, each generating NEW tokens, all added at once;
- TTFT at each prompt length: the time to the first token of a fresh prompt.
transformers' `generate` runs the same in the same dtype in the same process (static
batches of the same prompts; its TTFT is generate(max_new_tokens=1)).

Shoal runs with CUDA graphs (EngineConfig.cuda_graphs, the default; the capture time is
printed) and, at `--eager-concurrency` (1 and 64 on a GPU), again without them, so the
graphs' share of the figures is measured in the same run. Against issue 37's targets
(one H100 or H200, bfloat16): Llama-3-8B batch-1 decode <= 7 ms (<= 1.4x the floor),
SmolLM2 batch-1 <= 2 ms, >= 5,000 tok/s at 64 sequences and >= 10,000 at 256, >= 10x
transformers at 64 and 256; each line says whether it holds.

On a GPU the defaults are SmolLM2's and Llama-3-8B's shapes in bfloat16 at 1, 8, 64
and 256 sequences, TTFT at 512 and 4,096 tokens. Without one, a small shape in float32
at 1 and 8 sequences, TTFT at 64 tokens: enough to keep this script from rotting in CI.

The last line printed is a JSON list with every figure.
"""

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine import EngineConfig, LLMEngine  # noqa: E402
from app.models.attention_backends import select_backend  # noqa: E402
from app.models.loader import random_model  # noqa: E402
from app.models.source import ModelSource  # noqa: E402
from app.protocol import SamplingParams  # noqa: E402

SHAPES = {
    "tiny": dict(  # CPU: keeps the script honest in CI
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
}
PROMPT, NEW = 128, 128
DEFAULTS = {  # by the device chosen: --device=cpu on a GPU host runs the CPU set
    "gpu": dict(
        shapes="smollm2-135m,llama3-8b",
        dtype="bfloat16",
        concurrency="1,8,64,256",
        ttft="512,4096",
        kv_gib=16.0,
        eager_concurrency="1,64",
    ),
    "cpu": dict(
        shapes="tiny",
        dtype="float32",
        concurrency="1,8",
        ttft="64",
        kv_gib=0.25,
        eager_concurrency="",
    ),
}
# issue 37's targets: (shape, figure) -> (bound, at least / at most)
TARGETS = {
    ("llama3-8b", "decode_ms"): (7.0, "max"),
    ("smollm2-135m", "decode_ms"): (2.0, "max"),
    (None, "tok_s_64"): (5000.0, "min"),
    (None, "tok_s_256"): (10000.0, "min"),
    (None, "ratio_64"): (10.0, "min"),
    (None, "ratio_256"): (10.0, "min"),
}


def write_config(shape: str, root: Path) -> ModelSource:
    from transformers import LlamaConfig

    directory = root / shape
    LlamaConfig(max_position_embeddings=8192, **SHAPES[shape]).save_pretrained(directory)
    return ModelSource(name=shape, directory=directory)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of 5."""
    n = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n / best


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (count, length), generator=g).tolist()


def shoal_figures(engine: LLMEngine, args: argparse.Namespace, vocab: int, concurrency) -> dict:
    device = engine.config.torch_device
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    # warm-up at the measured prompt length: the first steps at new shapes cost extra
    engine.generate(prompts(2, PROMPT, vocab, 0), SamplingParams(max_tokens=4))
    # batch-1 decode: time the steps after the first (which prefills)
    engine.add_request("one", prompts(1, PROMPT, vocab, 1)[0], params)
    engine.step()
    sync(device)
    start, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    decode_ms = (time.perf_counter() - start) * 1000 / steps
    throughput = {}
    for n in concurrency:
        start = time.perf_counter()
        outs = engine.generate(prompts(n, PROMPT, vocab, 2), params)
        elapsed = time.perf_counter() - start
        throughput[n] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
    graphs = engine.runner.decode_graphs
    figures = {"decode_ms": decode_ms, "tok_s": throughput, "cuda_graphs": graphs is not None}
    if graphs is not None:
        figures["capture_s"] = round(graphs.capture_s, 2)
    return figures


def ttft_figures(engine: LLMEngine, args: argparse.Namespace, vocab: int) -> dict:
    ttft = {}
    for length in args.ttft:
        best = float("inf")
        for seed in range(3):  # fresh prompts: no prefix-cache hit
            engine.add_request(
                f"t{length}-{seed}",
                prompts(1, length, vocab, 10 + seed)[0],
                SamplingParams(max_tokens=1),
            )
            start = time.perf_counter()
            while not engine.step():
                pass
            best = min(best, time.perf_counter() - start)
            while engine.has_work:
                engine.step()
        ttft[length] = best * 1000
    return ttft


def hf_figures(
    source: ModelSource, dtype: torch.dtype, device: torch.device, args, vocab: int
) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source.directory)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()

    def generate(ids: list[list[int]], new: int) -> float:
        batch = torch.tensor(ids, device=device)
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        sync(device)
        return time.perf_counter() - start

    generate(prompts(1, 16, vocab, 0), 4)  # warm-up
    one = prompts(1, PROMPT, vocab, 1)
    decode_ms = (generate(one, NEW + 1) - generate(one, 1)) * 1000 / NEW
    throughput = {
        n: n * NEW / generate(prompts(n, PROMPT, vocab, 2), NEW) for n in args.concurrency
    }
    ttft = {
        length: min(generate(prompts(1, length, vocab, 10 + s), 1) for s in range(3)) * 1000
        for length in args.ttft
    }
    return {"decode_ms": decode_ms, "tok_s": throughput, "ttft_ms": ttft}


def run_shape(shape: str, args: argparse.Namespace, root: Path, bandwidth: float) -> dict:
    source = write_config(shape, root)
    config = EngineConfig(
        model=str(source.directory),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(args.concurrency),
        max_model_len=max(max(args.ttft), PROMPT + NEW) + 16,
        kv_cache_memory_gib=args.kv_gib,
    )
    device, dtype = config.torch_device, config.torch_dtype
    backend = select_backend(config.attention_backend, device, config.block_size)
    loaded = random_model(source, backend, dtype, device, config.max_model_len)
    arch = loaded.arch
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    weight_bytes += sum(b.numel() * b.element_size() for b in loaded.model.buffers())
    # a step reads one row of an untied input embedding, not the table (a tied one is
    # read whole as the LM head)
    embedding = loaded.model.model.embed_tokens.weight
    read_bytes = weight_bytes - (0 if arch.tie_word_embeddings else embedding.nbytes)
    kv_bytes = 2 * arch.num_layers * arch.kv_size * dtype.itemsize * (PROMPT + NEW // 2)
    # The copy's figure counts bytes read and written: what the memory moves per second,
    # the rate at which one step's reads can go at best.
    floor_ms = (read_bytes + kv_bytes) / bandwidth * 1000
    engine = LLMEngine(config, loaded=loaded)
    ours = shoal_figures(engine, args, arch.vocab_size, args.concurrency)
    ours["ttft_ms"] = ttft_figures(engine, args, arch.vocab_size)
    ours["attention_backend"] = engine.runner.backend.name
    del engine
    eager = None
    if args.eager_concurrency and ours["cuda_graphs"]:
        release(device)
        engine = LLMEngine(config.model_copy(update={"cuda_graphs": False}), loaded=loaded)
        eager = shoal_figures(engine, args, arch.vocab_size, args.eager_concurrency)
        del engine
    del loaded
    release(device)
    result = {
        "shape": shape,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "weight_gb": round(weight_bytes / 1e9, 3),
        "floor_ms": round(floor_ms, 3),
        "shoal": ours,
        "decode_vs_floor": round(ours["decode_ms"] / floor_ms, 2),
    }
    if eager is not None:
        result["shoal_eager"] = eager
    if not args.skip_hf:
        theirs = hf_figures(source, dtype, device, args, arch.vocab_size)
        result["transformers"] = theirs
        result["tok_s_ratio"] = {
            n: round(ours["tok_s"][n] / theirs["tok_s"][n], 2) for n in args.concurrency
        }
    result["targets"] = check_targets(result) if device.type == "cuda" else {}
    print_shape(result, args)
    return result


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_targets(r: dict) -> dict:
    """Each of issue 37's targets this run measured: {name: [value, bound, held]}."""
    values = {"decode_ms": r["shoal"]["decode_ms"]}
    for n in (64, 256):
        if n in r["shoal"]["tok_s"]:
            values[f"tok_s_{n}"] = r["shoal"]["tok_s"][n]
        if n in r.get("tok_s_ratio", {}):
            values[f"ratio_{n}"] = r["tok_s_ratio"][n]
    held = {}
    for (shape, name), (bound, kind) in TARGETS.items():
        if shape not in (None, r["shape"]) or name not in values:
            continue
        value = values[name]
        ok = value <= bound if kind == "max" else value >= bound
        held[name] = [round(value, 2), bound, ok]
    return held


def print_shape(r: dict, args: argparse.Namespace) -> None:
    hf, ours, eager = r.get("transformers"), r["shoal"], r.get("shoal_eager")
    graphs = f"CUDA graphs captured in {ours['capture_s']} s" if ours["cuda_graphs"] else "eager"
    print(f"== {r['shape']} on {r['device']} ({r['dtype']}), weights {r['weight_gb']} GB")
    print(f"attention backend {ours['attention_backend']}, {graphs}")
    print(
        f"batch-1 decode: shoal {ours['decode_ms']:.2f} ms/step, floor {r['floor_ms']:.2f} ms "
        f"({r['decode_vs_floor']}x)"
        + (f", eager {eager['decode_ms']:.2f} ms" if eager else "")
        + (f", transformers {hf['decode_ms']:.2f} ms" if hf else "")
    )
    for n in args.concurrency:
        line = f"{n:4d} sequences: shoal {ours['tok_s'][n]:9.1f} tok/s"
        if eager and n in eager["tok_s"]:
            line += f" (eager {eager['tok_s'][n]:9.1f})"
        if hf:
            line += f", transformers {hf['tok_s'][n]:9.1f} tok/s ({r['tok_s_ratio'][n]}x)"
        print(line)
    for length in args.ttft:
        line = f"TTFT({length}): shoal {ours['ttft_ms'][length]:.1f} ms"
        if hf:
            line += f", transformers {hf['ttft_ms'][length]:.1f} ms"
        print(line)
    for name, (value, bound, ok) in r["targets"].items():
        print(f"target {name}: {value} against {bound}: {'met' if ok else 'NOT met'}")


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    # the rest default by the device (DEFAULTS)
    parser.add_argument("--shapes")
    parser.add_argument("--dtype")
    parser.add_argument("--concurrency")
    parser.add_argument("--ttft")
    parser.add_argument("--kv-gib", type=float)
    parser.add_argument("--eager-concurrency", help="concurrencies run again without graphs")
    parser.add_argument("--skip-hf", action="store_true", help="only Shoal's figures")
    args = parser.parse_args()
    gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    for name, value in DEFAULTS["gpu" if gpu else "cpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    args.ttft = [int(n) for n in args.ttft.split(",")]
    args.eager_concurrency = [int(n) for n in args.eager_concurrency.split(",") if n]
    device = torch.device("cuda" if gpu else "cpu")
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth on {device}: {bandwidth / 1e9:.1f} GB/s (read + write)")
    results = []
    with tempfile.TemporaryDirectory() as root:
        for shape in args.shapes.split(","):
            results.append(run_shape(shape, args, Path(root), bandwidth))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
