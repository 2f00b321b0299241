"""Writing a step's keys and values into their cache slots."""

import torch
import triton
import triton.language as tl

from app.models.triton_kernels.common import cast_for_store, rows_contiguous


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_cs,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    token, head = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token (a batch padded to a captured graph's size)
        return
    d = tl.arange(0, HEAD_PAD)
    mask = d < HEAD_DIM
    dst = (slot // BLOCK_SIZE) * stride_cb + head * stride_ch + (slot % BLOCK_SIZE) * stride_cs + d
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=mask).to(tl.float32)
    tl.store(k_cache_ptr + dst, cast_for_store(k, k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, cast_for_store(v, v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,  # (T, nkv, hd)
    v: torch.Tensor,  # (T, nkv, hd)
    k_cache: torch.Tensor,  # (num_blocks, nkv, block_size, hd)
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # (T,) int64; -1: skip this token
) -> None:
    """k[t] and v[t] into slot slots[t] (block * block_size + offset), converted to the
    cache's dtype as torch's .to() converts (bfloat16 and float16: to nearest even)."""
    t, nkv, hd = k.shape
    if t == 0:
        return
    k, v = rows_contiguous(k), rows_contiguous(v)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    _write_kv_kernel[(t, nkv)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[2],
        HEAD_DIM=hd,
        HEAD_PAD=triton.next_power_of_2(hd),
    )
