"""Before GPU time: compile app/models/triton_kernels for NVIDIA sm_90 / sm_80 on a machine
without a GPU, and report each launch's registers, spills and shared memory.

The host wrappers (write_kv_cache, paged_decode_attention, paged_prefill_attention) run
unchanged on small CPU tensors of the real shapes; each kernel's `run` is intercepted and,
instead of launching, builds the exact (signature, constexprs, attrs) that JITFunction.run
would (Triton's own binder + _pack_args, so pointer dtypes, int==1 -> constexpr and
divisible-by-16 specialisations match a real launch), then triton.compile()s it for each
target. `dot_types` and `float32_products_on_gpu` are patched to answer as for a CUDA
tensor (the wrappers' only is_cuda tests). It leans on Triton 3.9's internals (the
binder, `_pack_args`): another release may need it adapted.
Registers / spills / stack come from `cuobjdump -res-usage` on the produced cubin
(falls back to `ptxas -v` on the PTX); shared memory is Triton's metadata.shared.

Run:  env -u TRITON_INTERPRET .venv/bin/python scripts/triton_preflight.py [--arch 90,80] [--only NAME] [-j 2]
(about 5 minutes on 2 cores the first time; compiled kernels are cached under
$TRITON_CACHE_DIR, by default /tmp/triton_preflight_cache).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.pop("TRITON_INTERPRET", None)  # real JITFunctions, not the interpreter
os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/triton_preflight_cache")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from app.models.triton_kernels import cache_write, decode, prefill  # noqa: E402

assert isinstance(decode._decode_partition_kernel, JITFunction), "interpreter active?"

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
MAX_SMEM = {80: 163 * 1024, 90: 227 * 1024}  # opt-in max per block (A100 / H100)


# ---- dot_types as on CUDA ---------------------------------------------------------------
def cuda_dot_types(q):
    if q.dtype == torch.float16:
        return tl.float16, "tf32"
    if q.dtype == torch.bfloat16:
        return tl.bfloat16, "tf32"
    return tl.float32, "ieee"


decode.dot_types = cuda_dot_types
prefill.dot_types = cuda_dot_types
decode.float32_products_on_gpu = lambda q: q.dtype == torch.float32
prefill.float32_products_on_gpu = lambda q: q.dtype == torch.float32

# ---- intercept launches -----------------------------------------------------------------
CAPTURED = []  # (kernel, signature, constexprs, attrs, options-dict, label)
_BINDERS = {}


def make_fake_run(kernel):
    backend = make_backend(GPUTarget("cuda", 90, 32))  # binder/attr logic is arch-independent

    def fake_run(*args, grid, warmup, **kwargs):
        if kernel not in _BINDERS:
            _BINDERS[kernel] = create_function_from_signature(
                kernel.signature, kernel.params, backend
            )
        bound_args, specialization, options = _BINDERS[kernel](*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, kwargs, bound_args, specialization, options
        )
        CAPTURED.append(
            (
                kernel,
                signature,
                constexprs,
                attrs,
                dict(num_warps=options.num_warps, num_stages=options.num_stages),
                CURRENT_LABEL[0],
            )
        )
        return None

    return fake_run


KERNELS = [
    cache_write._write_kv_kernel,
    decode._decode_partition_kernel,
    decode._decode_reduce_kernel,
    prefill._prefill_kernel,
]
for k in KERNELS:
    k.run = make_fake_run(k)

CURRENT_LABEL = [""]


# ---- configurations ---------------------------------------------------------------------
def drive(
    label,
    nh,
    nkv,
    hd,
    qdt,
    cdt=None,
    bs=16,
    softcaps=(0.0, 30.0),
    window=0,
    decode_splits=(1, 4),
    reduce_splits=(),
    seqs=2,
):
    """Call the real host wrappers with CPU tensors shaped as a model's step."""
    cdt = cdt or qdt
    nblocks, nblk, T = 8, 4, 5
    qkv = torch.zeros(T, (nh + 2 * nkv) * hd, dtype=qdt)  # q, k, v are views of one projection
    q = qkv[:, : nh * hd].view(T, nh, hd)
    k = qkv[:, nh * hd : (nh + nkv) * hd].view(T, nkv, hd)
    v = qkv[:, (nh + nkv) * hd :].view(T, nkv, hd)
    kc = torch.zeros(nblocks, nkv, bs, hd, dtype=cdt)
    vc = torch.zeros_like(kc)
    slots = torch.arange(T, dtype=torch.long)
    tables = torch.zeros(seqs, nblk, dtype=torch.int32)
    lens = torch.full((seqs,), 20, dtype=torch.int32)
    scale = hd**-0.5
    CURRENT_LABEL[0] = label
    cache_write.write_kv_cache(k, v, kc, vc, slots)
    for sc in softcaps:
        for s in decode_splits:
            out = torch.empty(seqs, nh, hd, dtype=qdt)
            decode.paged_decode_attention(q[:seqs], kc, vc, tables, lens, scale, window, sc, out, s)
        out = torch.empty(T, nh, hd, dtype=qdt)
        starts = torch.tensor([0, T], dtype=torch.int32)
        prefill.paged_prefill_attention(
            q, kc, vc, tables[:1], lens[:1], starts, T, scale, window, sc, out
        )
    for s in reduce_splits:  # the reduce kernel alone (softcap irrelevant)
        out = torch.empty(seqs, nh, hd, dtype=qdt)
        decode.paged_decode_attention(q[:seqs], kc, vc, tables, lens, scale, window, 0.0, out, s)


bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
ALL_SPLITS = tuple(range(2, 17))
CONFIGS = [
    # name,             nh, nkv, hd, q dtype, cache dtype, extra
    ("smollm2-135m", 9, 3, 64, bf16, bf16, dict(reduce_splits=ALL_SPLITS)),
    ("llama3-8b", 32, 8, 128, bf16, bf16, dict(reduce_splits=ALL_SPLITS)),
    ("fp32-hd64", 4, 2, 64, fp32, fp32, dict(reduce_splits=ALL_SPLITS)),
    ("fp32-hd96", 4, 2, 96, fp32, fp32, {}),
    ("fp32-hd128", 4, 2, 128, fp32, fp32, {}),
    ("fp32-hd256", 4, 2, 256, fp32, fp32, dict(reduce_splits=ALL_SPLITS)),
    ("fp32q-bf16cache", 4, 2, 64, fp32, bf16, {}),
    ("fp32q-fp16cache", 4, 2, 64, fp32, fp16, {}),
    ("fp32-group8", 8, 1, 64, fp32, fp32, dict(softcaps=(0.0,))),
    ("fp32-group3", 6, 2, 64, fp32, fp32, dict(softcaps=(0.0,))),
    ("fp16-hd64", 4, 2, 64, fp16, fp16, {}),
    ("bf16-hd64-g2", 4, 2, 64, bf16, bf16, {}),
    ("bf16-hd96", 4, 2, 96, bf16, bf16, {}),
    ("bf16-hd256", 4, 2, 256, bf16, bf16, dict(reduce_splits=ALL_SPLITS)),
    ("bf16-hd64-win50", 9, 3, 64, bf16, bf16, dict(window=50, softcaps=(30.0,))),
]


# ---- compile + measure --------------------------------------------------------------------
def res_usage(cubin: bytes, arch: int):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        r = subprocess.run(
            [os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True, text=True
        )
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", r.stdout)
        if m:
            reg, stack, shared, local = map(int, m.groups())
            return dict(
                regs=reg,
                stack=stack,
                static_smem=shared,
                local=local,
                spill_st=None,
                spill_ld=None,
                src="cuobjdump",
            )
    finally:
        os.remove(path)
    return None


def ptxas_v(ptx: str, arch: int):
    tool = "ptxas" if arch < 90 else "ptxas-blackwell"
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        r = subprocess.run(
            [
                os.path.join(BIN, tool),
                "-lineinfo",
                "-v",
                "--regAllocOptLevel=2",
                f"--gpu-name={gpu}",
                p,
                "-o",
                os.path.join(d, "k.o"),
            ],
            capture_output=True,
            text=True,
        )
    log = r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    st = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    smem = re.search(r"(\d+) bytes smem", log)
    return dict(
        regs=int(regs.group(1)) if regs else None,
        spill_st=int(st.group(1)) if st else None,
        spill_ld=int(st.group(2)) if st else None,
        stack=int(stack.group(1)) if stack else None,
        static_smem=int(smem.group(1)) if smem else 0,
        src="ptxas -v",
        log=log,
    )


def short_consts(kernel, constexprs):
    names = kernel.arg_names
    keep = (
        "GROUP",
        "GROUP_PAD",
        "HEAD_PAD",
        "BLOCK_M",
        "BLOCK_Q",
        "TILE_N",
        "SPLITS_PAD",
        "SINGLE",
        "USE_SOFTCAP",
        "DOT_DTYPE",
        "PRECISION",
    )
    out = []
    for (i,), v in sorted(constexprs.items()):
        n = names[i]
        if n in keep:
            v = str(v).replace("triton.language.", "").replace("tl.", "")
            out.append(f"{n}={v}")
    return " ".join(out)


def compile_one(item, arch):
    kernel, signature, constexprs, attrs, opts, label = item
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    t0 = time.time()
    try:
        ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(opts))
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        return dict(ok=False, err=msg, tb=traceback.format_exc(), secs=time.time() - t0)
    info = ptxas_v(ck.asm["ptx"], arch)  # spills need ptxas -v; cuobjdump lacks them
    cu = res_usage(ck.asm["cubin"], arch)
    return dict(
        ok=True,
        secs=time.time() - t0,
        shared=ck.metadata.shared,
        num_warps=ck.metadata.num_warps,
        num_stages=ck.metadata.num_stages,
        cubin_regs=cu["regs"] if cu else None,
        **{k: v for k, v in info.items() if k != "log"},
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="90,80")
    ap.add_argument("--only", default="", help="substring of config names to keep")
    ap.add_argument("--kernel", default="", help="substring of kernel names to keep")
    ap.add_argument("-j", type=int, default=1)
    ap.add_argument("--tb", action="store_true", help="print tracebacks of failures")
    args = ap.parse_args()
    archs = [int(a) for a in args.arch.split(",")]

    for name, nh, nkv, hd, qdt, cdt, extra in CONFIGS:
        if args.only and args.only not in name:
            continue
        drive(name, nh, nkv, hd, qdt, cdt, **extra)

    # dedupe identical compiles (same signature/constexprs/attrs/options), keep every label
    uniq = {}
    for item in CAPTURED:
        kernel, sig, ce, attrs, opts, label = item
        if args.kernel and args.kernel not in kernel.__name__:
            continue
        key = (
            kernel.__name__,
            tuple(sorted(sig.items())),
            tuple(sorted((k, str(v)) for k, v in ce.items())),
            tuple(sorted((k, str(v)) for k, v in attrs.items())),
            tuple(sorted(opts.items())),
        )
        if key in uniq:
            if label not in uniq[key][1]:
                uniq[key][1].append(label)
        else:
            uniq[key] = (item, [label])
    jobs = [(item, labels, arch) for item, labels in uniq.values() for arch in archs]
    print(
        f"{len(CAPTURED)} launches captured, {len(uniq)} distinct specialisations, "
        f"{len(jobs)} compiles\n",
        flush=True,
    )

    if args.j > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        _JOBS[:] = [(i, a) for i, _, a in jobs]  # inherited by the forked workers
        with ProcessPoolExecutor(args.j, mp_context=multiprocessing.get_context("fork")) as ex:
            results = list(ex.map(_compile_job, range(len(_JOBS))))
    else:
        results = [_compile_job((i, a)) for i, _, a in jobs]

    hdr = (
        f"{'sm':>3} {'kernel':<26} {'configs':<34} {'sig':<14} {'constexprs':<72} "
        f"{'warps':>5} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem B':>7} flag"
    )
    print(hdr)
    print("-" * len(hdr))
    flagged = []
    for (item, labels, arch), r in sorted(
        zip(jobs, results, strict=True),
        key=lambda x: (-x[0][2], KERNELS.index(x[0][0][0]), x[0][1][0]),
    ):
        kernel, sig, ce, attrs, opts, _ = item
        sigs = (
            f"q/c/o:{sig.get('q_ptr', sig.get('k_ptr', sig.get('part_out_ptr')))[1:]}"
            f"/{sig.get('k_cache_ptr', sig.get('part_lse_ptr', ''))[1:]}"
            f"/{sig.get('out_ptr', sig.get('v_cache_ptr', ''))[1:]}"
        )
        lab = ",".join(labels)
        if len(lab) > 34:
            lab = lab[:31] + "..."
        cs = short_consts(kernel, ce)
        if not r["ok"]:
            line = (
                f"{arch:>3} {kernel.__name__:<26} {lab:<34} {sigs:<14} {cs:<72} FAILED: {r['err']}"
            )
            flagged.append(line)
            print(line)
            if args.tb:
                print(r["tb"])
            continue
        flags = []
        if (r["spill_st"] or 0) > 0 or (r["spill_ld"] or 0) > 0:
            flags.append("SPILLS")
        smem = r["shared"]
        if smem > 100 * 1024:
            flags.append("SMEM>100KB")
        if smem > MAX_SMEM[arch]:
            flags.append(f"SMEM>{MAX_SMEM[arch] // 1024}KB-MAX")
        if smem > 48 * 1024:
            flags.append("smem>48KB(opt-in)")
        if r["regs"] and r["regs"] * opts["num_warps"] * 32 > 65536:
            flags.append("REGS>RF")
        line = (
            f"{arch:>3} {kernel.__name__:<26} {lab:<34} {sigs:<14} {cs:<72} {r['num_warps']:>5} "
            f"{r['regs']:>4} {str(r['spill_st']) + '/' + str(r['spill_ld']):>11} {r['stack']:>5} "
            f"{smem:>7} {' '.join(flags)}"
        )
        if r["cubin_regs"] is not None and r["cubin_regs"] != r["regs"]:
            line += f" (cubin REG:{r['cubin_regs']})"
        print(line, flush=True)
        if flags:
            flagged.append(line)
    print(f"\n{len(flagged)} flagged")
    for line in flagged:
        print(line)


_JOBS = []


def _compile_job(ia):
    item, arch = _JOBS[ia] if isinstance(ia, int) else ia
    return compile_one(item, arch)


if __name__ == "__main__":
    main()
