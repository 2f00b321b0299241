"""Prefill (and extend) attention over the paged cache: variable-length query chunks.

Each chunk is the last q_len tokens of its sequence's context, so a chunk after a cached
prefix attends to the prefix in place through its block table; its own keys are already
in the cache (written first). One program per (chunk, tile of query tokens, kv head);
its rows are the tile's tokens times the query heads sharing that kv head (token-major),
so each key tile loaded serves the whole group. A program reads keys only from the
first one its first query's window reaches to its last query's position: the causal
bound and the blocks before a window are skipped, not masked.
"""

import torch
import triton
import triton.language as tl

from app.models.triton_kernels.common import (
    attend_tile,
    cast_for_store,
    dot_types,
    first_visible,
    float32_products_on_gpu,
    rows_contiguous,
)

ROWS = 64  # query rows (tokens x grouped heads) per program


@triton.jit
def _prefill_kernel(
    q_ptr,  # (T, nh, hd) the chunks' queries, chunk after chunk
    k_cache_ptr,  # (num_blocks, nkv, block_size, hd)
    v_cache_ptr,
    tables_ptr,  # (P, nblk) int32
    lens_ptr,  # (P,) int32 context lengths, this chunk included
    starts_ptr,  # (P + 1,) int32 query offsets
    out_ptr,  # (T, nh, hd)
    scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_cs,
    stride_tab,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows, a power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query tokens: BLOCK_M // GROUP
    TILE_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    chunk, q_tile, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(starts_ptr + chunk)
    q_len = tl.load(starts_ptr + chunk + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # the grid covers the longest chunk
        return
    context = tl.load(lens_ptr + chunk)
    offset = context - q_len  # position of the chunk's first token

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_PAD)
    n = tl.arange(0, TILE_N)
    q_idx = q_tile * BLOCK_Q + r // GROUP  # (M,) token within the chunk
    heads = kv_head * GROUP + r % GROUP  # (M,)
    row_ok = (r < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_ok = d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]  # (M, D)
    q_rows = (q_start + q_idx).to(tl.int64) * stride_qt + heads * stride_qh  # (M,)
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=q_mask)
    q = q.to(tl.float32).to(DOT_DTYPE)
    pos = offset + q_idx  # (M,) each row's position

    lo = first_visible(offset + q_tile * BLOCK_Q, window)
    hi = tl.minimum(offset + (q_tile + 1) * BLOCK_Q, context)  # past the tile's last query
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table = tables_ptr + chunk.to(tl.int64) * stride_tab
    head_base = kv_head.to(tl.int64) * stride_ch
    for tile in range(lo // TILE_N * TILE_N, hi, TILE_N):
        key = tile + n  # (N,) key positions
        valid = (key >= lo) & (key < hi)
        block = tl.load(table + key // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = block * stride_cb + head_base + (key % BLOCK_SIZE) * stride_cs  # (N,)
        k_t = tl.load(  # (D, N)
            k_cache_ptr + rows[None, :] + d[:, None], mask=d_ok[:, None] & valid[None, :]
        )
        v = tl.load(  # (N, D)
            v_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :]
        )
        k_t = k_t.to(tl.float32).to(DOT_DTYPE)
        v = v.to(tl.float32).to(DOT_DTYPE)
        seen = valid[None, :] & (key[None, :] <= pos[:, None])  # (M, N) causal
        seen &= (key[None, :] > pos[:, None] - window) | (window <= 0)
        m_i, l_i, acc = attend_tile(
            q, k_t, v, seen, m_i, l_i, acc, scale, softcap, USE_SOFTCAP, PRECISION
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows may have seen nothing
    o_rows = (q_start + q_idx).to(tl.int64) * stride_ot + heads * stride_oh
    dst = out_ptr + o_rows[:, None] + d[None, :]
    tl.store(dst, cast_for_store(out, out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    q: torch.Tensor,  # (T, nh, hd)
    k_cache: torch.Tensor,  # (num_blocks, nkv, block_size, hd)
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # (P, nblk) int32
    lens: torch.Tensor,  # (P,) int32
    starts: torch.Tensor,  # (P + 1,) int32
    max_query_len: int,
    scale: float,
    window: int,
    softcap: float,
    out: torch.Tensor,  # (T, nh, hd), q's dtype
) -> None:
    tokens, nh, hd = q.shape
    nkv, block_size = k_cache.shape[1], k_cache.shape[2]
    if tokens == 0:
        return
    q = rows_contiguous(q)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    group = nh // nkv
    head_pad = triton.next_power_of_2(hd)
    if float32_products_on_gpu(q):  # register-bound: a quarter of the tile or less
        width, tile, warps = (32, 32, 8) if head_pad <= 128 else (16, 16, 8)
    else:  # 8 warps from hd 128: 4 spilled a little on sm_80
        width, tile, warps = (ROWS, 64, 4 if head_pad <= 64 else 8)
        if head_pad > 128:
            tile = 32
    rows = max(width, triton.next_power_of_2(group))
    block_q = rows // group
    dot_dtype, precision = dot_types(q)
    grid = (tables.shape[0], triton.cdiv(max_query_len, block_q), nkv)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        starts,
        out,
        scale,
        softcap,
        window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        GROUP=group,
        HEAD_DIM=hd,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=rows,
        BLOCK_Q=block_q,
        TILE_N=tile,
        USE_SOFTCAP=softcap > 0,
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        num_warps=warps,
    )
