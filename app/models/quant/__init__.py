"""Linear layers and embeddings on GGUF-quantised weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
Q6_K), so a decode step reads each weight byte once instead of a bfloat16 copy 2-3x its
size.

    packed = pack(raw_rows, QuantType.Q4_1)       # lossless; unpack() gives the bytes back
    matmul(x, packed, out=fused[:, 0:576])        # out = x @ W^T, out may be a column slice
    grouped_matmul(xs, experts, starts)           # each expert's rows of xs @ its W^T
    embedding(ids, packed, torch.bfloat16)        # dequantised rows

By default x is rounded to int8 per 32-block where the type has an integer kernel (Q4_0,
Q4_1, Q8_0, Q4_K; gemv_i8.h), as llama.cpp does on every CPU matmul: 1.3-1.5x faster
products than float32 x. The rounding turns any summation-order difference before it
into a visible one, so a quantized model's forward is batch-invariant: the int8 GEMV
takes any number of rows with the same per-row arithmetic, and attention takes every
query token alone (TorchPagedAttention.token_by_token), and silu(gate) * up walks each
row alone (cpu_kernels/silu_mul.h). A token's
logits are then the same
bits in a prompt, a prefill chunk after a cached prefix or a decode. Not for Q5_K and Q6_K
layers (no integer kernel: the float GEMV's passes, and the tiles, depend on the row count).
SHOAL_QUANT_ACTIVATIONS=float (or float_activations = True) keeps x in float32: results
are the dequantized weights' but for summation order.

The C++ kernels (kernels.cpp) are compiled on first use like app.models.cpu_kernels: cached
under ~/.cache/torch_extensions by a hash of the sources and the CPU flags. `load()` returns
None when they cannot be built or SHOAL_QUANT_KERNELS=0; matmul and embedding then
dequantise with gguf's numpy code and use torch (exact, slow).
"""

import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch

from app.models.kernel_build import Builds, build_extension, cpu_signature
from app.models.quant.formats import QuantType, dequantize
from app.models.quant.packed_weight import PackedWeight
from app.models.quant.packing import dequantize_packed, pack, unpack

__all__ = [
    "PackedWeight",
    "QuantType",
    "available",
    "dequantize",
    "dequantize_packed",
    "embedding",
    "grouped_matmul",
    "load",
    "matmul",
    "nbytes",
    "pack",
    "unpack",
]

logger = logging.getLogger(__name__)
# Read per call by matmul: tests (and a caller wanting exact products) may set it.
float_activations = os.environ.get("SHOAL_QUANT_ACTIVATIONS", "int8") == "float"
_SOURCES = (
    "kernels.cpp",
    "decode_layer.cpp",
    "moe_experts.cpp",
    "formats.h",
    "gemv.h",
    "gemv_i8.h",
    "matmul.h",
    "quantize_x.h",
    "simd.h",
    "../cpu_kernels/decode_attention.h",
    "../cpu_kernels/norm_rope.h",
    "../cpu_kernels/silu_mul.h",
    "../cpu_kernels/vector_math.h",
)


# The builds: "native" (the CPU's own, what serving uses); "avx2", what a CPU without
# AVX-512 builds, compiled on an AVX-512 CPU only by tests, since there the AVX2 code
# (its int8 GEMV above all, where the CPU has VNNI) is otherwise never compiled;
# "portable", plain loops 16 floats wide like AVX-512's, so that tests check the generic
# code at the other vector width.
Build = Literal["native", "avx2", "portable"]
_BUILD_FLAGS: dict[str, list[str]] = {
    "native": [],
    "avx2": ["-mno-avx512f"],  # and with it every AVX-512 extension (VNNI, BW, BF16)
    "portable": ["-DSHOAL_QUANT_PORTABLE", "-DSHOAL_QUANT_PORTABLE_WIDTH=16"],
}


def _build_signature(build: Build) -> str:
    """CPU flags and sources in one hash: -march=native builds are valid only on CPUs with
    the same features, and an edited source must not find an older build of itself.
    The checkout's path too: torch's build file names the sources by path, so two
    checkouts sharing a name would each rebuild it for the other."""
    digest = hashlib.sha1(cpu_signature() + " ".join(_BUILD_FLAGS[build]).encode())
    digest.update(str(Path(__file__).resolve().parent).encode())
    for name in _SOURCES:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:10]


def _build(build: Build) -> ModuleType | None:
    try:
        return build_extension(
            f"shoal_quant_kernels_{build}_{_build_signature(build)}",
            [
                str(Path(__file__).with_name(name))
                for name in ("kernels.cpp", "decode_layer.cpp", "moe_experts.cpp")
            ],
            ["-O3", "-march=native", "-fopenmp", *_BUILD_FLAGS[build]],
            ["-fopenmp"],
        )
    except Exception as exc:  # no compiler, no headers: the torch path still works
        logger.warning("quantised-weight kernels unavailable, dequantising instead: %s", exc)
        return None


_builds = Builds(_BUILD_FLAGS, "SHOAL_QUANT_KERNELS", _build)


def load(build: Build = "native") -> ModuleType | None:
    """The compiled kernels (one of the builds above), or None."""
    return _builds.load(build)


def available() -> bool:
    return load() is not None


def matmul(x: torch.Tensor, packed: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """out (T, N) = x (T, K) @ W^T. x is float32, bfloat16 or float16; out defaults to a new
    tensor of x's dtype and may be a column slice of a wider one (unit column stride). With
    the kernels and float_activations off, x is rounded to int8 per block."""
    if out is None:
        out = torch.empty(x.shape[0], packed.n, dtype=x.dtype)
    module = load()
    if module is None:
        out.copy_(x.float() @ dequantize_packed(packed).T)
    else:
        activations = 1 if float_activations else 0  # kernels.cpp's kFloat, kAuto
        qtype, parts = packed.kernel_args  # converted once: a decode step makes ~120 calls
        module.quant_matmul(x, qtype, parts, packed.n, packed.k, out, 0, 0, activations)
    return out


def grouped_matmul(
    x: torch.Tensor, packed: PackedWeight, starts: list[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Experts stacked in `packed` (E = len(starts) - 1 of packed.n // E rows each): rows
    starts[e]..starts[e + 1] - 1 of x (grouped by expert) times expert e's W^T, in one
    call, into out (R, packed.n // E). Each row's result is what `matmul` gives it."""
    experts = len(starts) - 1
    rows = packed.n // experts
    if out is None:
        out = torch.empty(x.shape[0], rows, dtype=x.dtype)
    module = load()
    if module is None:
        for e in range(experts):
            if starts[e + 1] > starts[e]:
                expert = packed.rows(e * rows, (e + 1) * rows)
                part = out[starts[e] : starts[e + 1]]
                part.copy_(x[starts[e] : starts[e + 1]].float() @ dequantize_packed(expert).T)
    else:
        activations = 1 if float_activations else 0
        qtype, parts = packed.kernel_args
        module.quant_grouped_matmul(x, qtype, parts, packed.n, packed.k, starts, out, activations)
    return out


def embedding(
    ids: torch.Tensor, packed: PackedWeight, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rows of W for token ids of any shape -> ids.shape + (K,), dequantised exactly, then
    cast to dtype (as F.embedding would return them)."""
    flat = ids.reshape(-1).long()
    if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < packed.n:
        raise IndexError(f"token ids must lie in [0, {packed.n})")
    module = load()
    if module is None:
        rows = dequantize(unpack(packed)[flat], packed.qtype, packed.k).to(dtype)
    else:
        rows = torch.empty(flat.shape[0], packed.k, dtype=dtype)
        module.quant_embedding(
            flat, int(packed.qtype), list(packed.parts), packed.n, packed.k, rows
        )
    return rows.reshape(*ids.shape, packed.k)


def nbytes(weight: PackedWeight | torch.Tensor) -> int:
    """Bytes a weight holds in memory, packed or plain."""
    if isinstance(weight, PackedWeight):
        return weight.nbytes
    return weight.numel() * weight.element_size()
