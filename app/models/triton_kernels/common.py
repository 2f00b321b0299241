"""Pieces every Triton attention kernel here shares.

Loads widen to float32 at once and all arithmetic stays there: Triton's interpreter (the
CPU tests) computes bfloat16 arithmetic on the raw bits, and float32 is what the online
softmax needs anyway. Only the two matmuls of a tile may take narrower operands, where
the launcher asks for them (16-bit queries on a GPU: tensor cores at full rate).
"""

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp2 is one instruction


@triton.jit
def cast_for_store(x, dtype: tl.constexpr):
    """float32 `x` as `dtype`, rounded to nearest even. bfloat16 goes through the bits:
    the interpreter truncates a plain .to(bfloat16), and the cache must hold what
    torch's .to() would (the torch backend writes the same slots that way)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN stays NaN (rounding may not)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def tanh(x):
    """tanh from exp2 (the interpreter has no libdevice); e^{-2|x|} never overflows."""
    t = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def attend_tile(
    q,  # (M, D) query rows, dot dtype
    k_t,  # (D, N) keys, transposed, dot dtype
    v,  # (N, D) values, dot dtype
    visible,  # (M, N) or broadcastable: which scores count
    m_i,  # (M,) running max, base-2 units
    l_i,  # (M,) running sum of exp2(score - m_i)
    acc,  # (M, D) float32 running sum of p @ v
    scale,
    softcap,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One tile of keys into a flash-attention online softmax; returns (m_i, l_i, acc)."""
    s = tl.dot(q, k_t, input_precision=PRECISION) * scale  # (M, N) float32
    if USE_SOFTCAP:  # capped before masking, as the interface says
        s = softcap * tanh(s / softcap)
    s = tl.where(visible, s * LOG2E, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps max -inf: subtract 0 instead (exp2(-inf) = 0).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])  # (M, N)
    alpha = tl.exp2(m_i - m_ref)  # (M,) rescales what came before
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def first_visible(position, window):
    """The first key a query at `position` sees: position - window + 1, or 0."""
    return tl.where(window > 0, tl.maximum(position - window + 1, 0), 0)


# ---- host side ------------------------------------------------------------------------
def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels step over tokens and heads by stride (q, k and v are views of one qkv
    projection) but read each head's hd values as one contiguous run."""
    return x if x.stride(-1) == 1 else x.contiguous()


def dot_types(q: torch.Tensor) -> tuple[tl.dtype, str]:
    """The matmuls' operand type and precision. A 16-bit query on a GPU: its own type
    (tensor cores at full rate; probabilities rounded to it, as FlashAttention does).
    float32 queries: float32 products ('ieee', not TF32's 10-bit mantissa). The
    interpreter: float32 always (it would multiply 16-bit operands as float16)."""
    if q.is_cuda and q.dtype == torch.float16:
        return tl.float16, "tf32"
    if q.is_cuda and q.dtype == torch.bfloat16:
        return tl.bfloat16, "tf32"
    return tl.float32, "ieee"


def float32_products_on_gpu(q: torch.Tensor) -> bool:
    """Whether a GPU computes this attention's products as float32 FMAs (float32 queries:
    no tensor cores). There 64-key tiles of them spilled registers by the KB (ptxas -v for
    sm_90 and sm_80, Triton 3.9), so such launches take narrower tiles and more warps.
    Under the interpreter the tiles stay as for 16-bit queries: the same code either
    way, and the tests' partition counts assume them."""
    return q.is_cuda and q.dtype == torch.float32
