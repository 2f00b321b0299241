"""Quantised-weight kernels (app/models/quant) against torch on the same shapes (issue 21).

Per GGML type and the default model's (SmolLM2-135M) linear shapes: the fused GEMV at
T = 1, 4, 8 with int8-rounded activations (the default) and with float32 ones, its
effective bandwidth (packed bytes / time) beside a large torch sum's, and torch's bfloat16
and float32 GEMV of the same shape at T=1. Every timed call reads weights that are not in
cache (the bench cycles through copies adding up to more than the L3), as a decode step
over a whole model does. Then batched steps (T = 32/128/512): the kernels' automatic
choice against a float32 matmul on pre-dequantised weights, and the GEMV/tile crossover
(of the default GEMV; the float-activation one is timed beside it).
The last line is JSON.

    .venv/bin/python bench/quant_gemv.py          # about 3 min on 2 cores
    .venv/bin/python bench/quant_gemv.py --types Q4_1 --shapes 576x576 --batches ""

Times are the best of several rounds, the least disturbed by other work on the machine.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.models import quant  # noqa: E402
from app.models.quant import QuantType, dequantize_packed, pack  # noqa: E402

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]  # (N, K): q/o, gate/up, down, head
BATCHES = [32, 128, 512]
COLD_BYTES = 128 << 20  # cycle through this much weight memory: more than any L3 here


def random_raw(qtype: QuantType, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Valid GGUF rows: random bytes with small finite fp16 scales (values do not matter)."""
    blocks = n * k // qtype.block_elems
    raw = rng.integers(0, 256, size=(blocks, qtype.block_bytes), dtype=np.uint8)
    scales = (rng.random((blocks, 1)) * 0.01).astype(np.float16).view(np.uint8)
    at = {QuantType.Q6_K: [208], QuantType.Q4_K: [0, 2], QuantType.Q4_1: [0, 2]}.get(qtype, [0])
    for off in at:
        raw[:, off : off + 2] = scales
    return torch.from_numpy(raw.reshape(n, -1))


def timed(fn, args_cycle, min_s: float = 0.3) -> float:
    """Seconds per call in the best of several rounds of calls cycling through args_cycle:
    the best round is the one least disturbed by other work on a shared machine."""
    for a in args_cycle[:2]:
        fn(*a)
    rounds = []
    total = 0.0
    while total < min_s or len(rounds) < 5:
        t0 = time.perf_counter()
        for a in args_cycle:
            fn(*a)
        dt = (time.perf_counter() - t0) / len(args_cycle)
        rounds.append(dt)
        total += dt * len(args_cycle)
    return min(rounds)


def copies(nbytes: int) -> int:
    return max(1, math.ceil(COLD_BYTES / max(nbytes, 1)))


def memory_bandwidth() -> dict:
    src = torch.ones(256 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), [()], 1.0)
    as_float = src.view(torch.float32)
    sum_s = timed(lambda: as_float.sum(), [()], 1.0)
    return {"copy_gbs": 2 * src.numel() / copy_s / 1e9, "read_gbs": src.numel() / sum_s / 1e9}


def gemv_row(qtype: QuantType, n: int, k: int, t: int, rng) -> dict:
    """The GEMV at t rows of x with int8 activations (the default where the type has an
    integer kernel) and with float32 ones; torch's bf16 and f32 GEMV beside them at t=1."""
    # one matrix of c copies stacked; row slices of it are packed weights of their own
    c = copies(qtype.row_bytes(k) * n)
    big = pack(random_raw(qtype, n * c, k, rng), qtype)
    packed = [big.rows(i * n, (i + 1) * n) for i in range(c)]
    x = torch.randn(t, k)
    out = torch.empty(t, n)
    module = quant.load()
    row = {"type": qtype.name, "n": n, "k": k, "t": t, "bytes": packed[0].nbytes}
    for name, act in (("", 0), ("fx_", 1)):
        s = timed(
            lambda p, act=act: module.quant_matmul(
                x, int(qtype), list(p.parts), n, k, out, 1, 0, act
            ),
            [(p,) for p in packed],
        )
        row[f"{name}us"], row[f"{name}gbs"] = s * 1e6, packed[0].nbytes / s / 1e9
    for name, dt in (("bf16", torch.bfloat16), ("f32", torch.float32)):
        if t > 1:
            continue
        c = copies(n * k * dt.itemsize)
        w = torch.randn(n * c, k).to(dt).split(n)
        xd = x.to(dt)
        s = timed(lambda wi, xd=xd: torch.mm(xd, wi.T), [(wi,) for wi in w])
        row[f"{name}_us"], row[f"{name}_gbs"] = s * 1e6, n * k * dt.itemsize / s / 1e9
    return row


def batched_row(qtype: QuantType, n: int, k: int, t: int, rng) -> dict:
    packed = pack(random_raw(qtype, n, k, rng), qtype)
    wf = dequantize_packed(packed)
    x = torch.randn(t, k)
    out = torch.empty(t, n)
    module = quant.load()
    run = {
        "auto": lambda: quant.matmul(x, packed, out),
        "gemv": lambda: module.quant_matmul(x, int(qtype), list(packed.parts), n, k, out, 1),
        "gemv_fx": lambda: module.quant_matmul(
            x, int(qtype), list(packed.parts), n, k, out, 1, 0, 1
        ),
        "tiles": lambda: module.quant_matmul(x, int(qtype), list(packed.parts), n, k, out, 2),
        "f32": lambda: torch.mm(x, wf.T, out=out),
    }
    return {"type": qtype.name, "n": n, "k": k, "t": t} | {
        f"{name}_ms": timed(fn, [()], 0.2) * 1e3 for name, fn in run.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q6_K")
    ap.add_argument("--gemv-t", default="1,4,8", help="rows of x for the GEMV table")
    ap.add_argument("--shapes", default="", help="N x K pairs to keep, e.g. 576x576,49152x576")
    ap.add_argument("--crossover-t", default="1,2,4,8,12,16,24,32")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # one thread times the kernels on a busy machine
    if quant.load() is None:
        sys.exit("the quantised-weight kernels did not build")
    rng = np.random.default_rng(0)
    types = [QuantType[name] for name in args.types.split(",")]
    bw = memory_bandwidth()
    print(f"kernels: {quant.load().isa()}, threads: {torch.get_num_threads()}")
    print(
        f"memory: copy {bw['copy_gbs']:.1f} GB/s (read + write), sum {bw['read_gbs']:.1f} GB/s (read)"
    )
    print(
        f"\n{'type':6} {'N x K':>12} {'T':>2} {'KB':>6} {'int8x us':>8} {'GB/s':>5} {'%read':>5}"
        f" {'f32x us':>8} {'GB/s':>5} {'bf16 us':>8} {'GB/s':>5} {'f32 us':>7} {'GB/s':>5}"
    )
    shapes = [s for s in SHAPES if not args.shapes or f"{s[0]}x{s[1]}" in args.shapes.split(",")]
    gemv = []
    for qtype in types:
        for n, k in shapes:
            if k % qtype.block_elems:
                continue  # K-quants need K % 256 == 0; llama.cpp picks another type there
            for t in (int(t) for t in args.gemv_t.split(",")):
                r = gemv_row(qtype, n, k, t, rng)
                r["of_read"] = r["gbs"] / bw["read_gbs"]
                gemv.append(r)
                torch_cols = "".join(
                    f" {r[f'{d}_us']:8.1f} {r[f'{d}_gbs']:5.1f}"
                    if f"{d}_us" in r
                    else f" {'-':>8} {'-':>5}"
                    for d in ("bf16", "f32")
                )
                print(
                    f"{r['type']:6} {f'{n}x{k}':>12} {t:2} {r['bytes'] / 1024:6.0f} {r['us']:8.1f}"
                    f" {r['gbs']:5.1f} {100 * r['of_read']:4.0f}% {r['fx_us']:8.1f} {r['fx_gbs']:5.1f}"
                    + torch_cols
                )
    print(
        f"\n{'type':6} {'N x K':>12} {'T':>4} {'auto ms':>8} {'gemv ms':>8} {'f32x ms':>8}"
        f" {'tiles ms':>8} {'f32 mm ms':>9}"
    )
    batched = []
    ts = sorted({int(t) for t in (args.crossover_t + "," + args.batches).split(",") if t})
    for qtype in types:
        n, k = (1536, 576) if qtype.block_elems == 32 else (576, 1536)
        for t in ts:
            r = batched_row(qtype, n, k, t, rng)
            batched.append(r)
            print(
                f"{r['type']:6} {f'{n}x{k}':>12} {t:4} {r['auto_ms']:8.3f} {r['gemv_ms']:8.3f}"
                f" {r['gemv_fx_ms']:8.3f} {r['tiles_ms']:8.3f} {r['f32_ms']:9.3f}"
            )
    crossover = {}
    for qtype in types:
        rows = [r for r in batched if r["type"] == qtype.name]
        crossover[qtype.name] = next((r["t"] for r in rows if r["tiles_ms"] < r["gemv_ms"]), None)
    print(f"\nfirst T where tiles beat the GEMV: {crossover}")
    print(
        json.dumps(
            {
                "isa": quant.load().isa(),
                "memory": bw,
                "gemv": gemv,
                "batched": batched,
                "crossover": crossover,
            }
        )
    )


if __name__ == "__main__":
    main()
