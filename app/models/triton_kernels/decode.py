"""Decode attention over the paged cache, split over the context (flash-decoding).

One query token per sequence. Stage 1 runs one program per (sequence, kv head,
partition): the partition's keys, tile by tile, for the whole group of query heads that
share the kv head (one load of each key serves them all); it leaves each head's
normalised partial output and its log-sum-exp. Stage 2 weighs the partitions' outputs by
their share of the total. With one partition, stage 1 writes the output itself.

The host picks only the NUMBER of partitions, from the launch shape (sequences, kv heads,
the GPU's SM count): the grid and the partials buffer never depend on the block tables'
width or on the lengths in them, so a CUDA graph captured for a batch size serves every
context. Each program cuts its own sequence's visible span into that many runs of whole
tiles, in the kernel (`_partition`), never shorter than MIN_PARTITION: a short context
fills the first partitions and the rest return at once; stage 2 recomputes the same cut
to know which partitions were live instead of reading flags. No table entry at or past
a sequence's length, or wholly before its window, is read.
"""

import functools

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

MAX_SPLITS = 16  # partitions per (sequence, kv head) at most: bounds the partials buffer
MIN_PARTITION = 64  # tokens: a shorter run costs more in q loads and partials than it saves
SM_WAVES = 2  # stage-1 programs per SM the split aims for: one wave hides another's tail
INTERPRETER_SPLITS = 4  # off CUDA (Triton's interpreter, tests): enough to exercise stage 2


@triton.jit
def _partition(length, window, num_splits, TILE_N: tl.constexpr, MIN_TOKENS: tl.constexpr):
    """(first visible key, start of partition 0, tokens per partition) of a sequence of
    `length` cached tokens. The span from `first` (rounded down to a tile) to `length` is
    cut into `num_splits` runs of whole tiles, none under MIN_TOKENS; partition i covers
    [start + i * partition, start + (i + 1) * partition) clipped to `length`, and is live
    where that is not empty. Partition 0 holds `first`: every live one sees a key."""
    first = first_visible(length - 1, window)
    start = first // TILE_N * TILE_N
    partition = tl.maximum(tl.cdiv(length - start, num_splits), MIN_TOKENS)
    return first, start, tl.cdiv(partition, TILE_N) * TILE_N


@triton.jit
def _decode_partition_kernel(
    q_ptr,  # (S, nh, hd)
    k_cache_ptr,  # (num_blocks, nkv, block_size, hd)
    v_cache_ptr,
    tables_ptr,  # (S, nblk) int32
    lens_ptr,  # (S,) int32
    out_ptr,  # (S, nh, hd): written only with one partition
    part_out_ptr,  # (S, nh, num_splits, HEAD_PAD) float32
    part_lse_ptr,  # (S, nh, num_splits) float32, base 2
    scale,
    softcap,
    window,
    num_splits,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_cs,
    stride_tab,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # a power of two >= 16 (tl.dot's minimum on older GPUs)
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MIN_TOKENS: tl.constexpr,
    SINGLE: tl.constexpr,  # one partition: normalise and store the output here
    USE_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lens_ptr + seq)
    first, start, partition = _partition(length, window, num_splits, TILE_N, MIN_TOKENS)
    start += split * partition
    end = tl.minimum(start + partition, length)
    if start >= end:  # a span too short to fill every partition
        return

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    n = tl.arange(0, TILE_N)
    heads = kv_head * GROUP + g  # (G,)
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)  # (G, D)
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=q_mask)
    q = q.to(tl.float32).to(DOT_DTYPE)  # (G, D)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_tab
    head_base = kv_head.to(tl.int64) * stride_ch
    d_ok = d < HEAD_DIM
    for tile in range(start, end, TILE_N):
        pos = tile + n  # (N,) token positions
        valid = (pos >= first) & (pos < end)
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = block * stride_cb + head_base + (pos % BLOCK_SIZE) * stride_cs  # (N,)
        k_t = tl.load(  # (D, N)
            k_cache_ptr + rows[None, :] + d[:, None], mask=d_ok[:, None] & valid[None, :]
        )
        v = tl.load(  # (N, D)
            v_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :]
        )
        k_t = k_t.to(tl.float32).to(DOT_DTYPE)
        v = v.to(tl.float32).to(DOT_DTYPE)
        m_i, l_i, acc = attend_tile(
            q, k_t, v, valid[None, :], m_i, l_i, acc, scale, softcap, USE_SOFTCAP, PRECISION
        )

    out = acc / l_i[:, None]  # (G, D); every live partition saw at least one key
    if SINGLE:
        dst = out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, cast_for_store(out, out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (seq * GROUP * tl.num_programs(1) + heads) * num_splits + split  # (G,)
        tl.store(part_out_ptr + part[:, None] * HEAD_PAD + d[None, :], out, mask=q_mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=g < GROUP)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,  # (S, nh, num_splits, HEAD_PAD) float32
    part_lse_ptr,  # (S, nh, num_splits) float32
    lens_ptr,
    out_ptr,  # (S, nh, hd)
    window,
    num_splits,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    MIN_TOKENS: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    length = tl.load(lens_ptr + seq)
    _, start, partition = _partition(length, window, num_splits, TILE_N, MIN_TOKENS)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_PAD)
    # The partitions stage 1 did not skip (the same cut as its early return).
    live = (s < tl.cdiv(length - start, partition)) & (s < num_splits)
    part = (seq * tl.num_programs(1) + head) * num_splits + s  # (P,)
    lse = tl.load(part_lse_ptr + part, mask=live, other=float("-inf"))  # (P,)
    weight = tl.exp2(lse - tl.max(lse, 0))  # (P,); 0 where not live
    partial = tl.load(  # (P, D)
        part_out_ptr + part[:, None] * HEAD_PAD + d[None, :],
        mask=live[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(partial * weight[:, None], 0) / tl.sum(weight, 0)  # (D,)
    dst = out_ptr + seq * stride_os + head * stride_oh + d
    tl.store(dst, cast_for_store(out, out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# ---- host side ------------------------------------------------------------------------
def split_count(seqs: int, nkv: int, num_sms: int) -> int:
    """Partitions per (sequence, kv head): enough stage-1 programs to give every SM about
    SM_WAVES of them, at most MAX_SPLITS; a batch that fills the GPU alone takes one (the
    single-pass kernel, no partials). A function of the launch shape only."""
    return max(1, min(MAX_SPLITS, triton.cdiv(SM_WAVES * num_sms, seqs * nkv)))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_splits(seqs: int, nkv: int, device: torch.device) -> int:
    """The split for a launch on `device`; off CUDA a fixed INTERPRETER_SPLITS."""
    if device.type != "cuda":
        return INTERPRETER_SPLITS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return split_count(seqs, nkv, _sm_count(index))


def partials_buffers(
    seqs: int, nh: int, splits: int, head_pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's outputs, uninitialised: only live partitions are written or read (the
    tests fill them with NaN to prove it)."""
    parts = torch.empty(seqs, nh, splits, head_pad, dtype=torch.float32, device=device)
    lse = torch.empty(seqs, nh, splits, dtype=torch.float32, device=device)
    return parts, lse


def paged_decode_attention(
    q: torch.Tensor,  # (S, nh, hd)
    k_cache: torch.Tensor,  # (num_blocks, nkv, block_size, hd)
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # (S, nblk) int32; read only below each length
    lens: torch.Tensor,  # (S,) int32, cached tokens including this one (>= 1)
    scale: float,
    window: int,
    softcap: float,
    out: torch.Tensor,  # (S, nh, hd), q's dtype
    num_splits: int | None = None,  # None: decode_splits' choice
) -> None:
    seqs, nh, hd = q.shape
    nkv, block_size = k_cache.shape[1], k_cache.shape[2]
    if seqs == 0:
        return
    q = rows_contiguous(q)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    head_pad = triton.next_power_of_2(hd)
    if float32_products_on_gpu(q):
        tile, warps = 32, 8
    else:  # keys per step: registers bound it at hd 256
        tile, warps = (64, 4) if head_pad <= 128 else (32, 8)
    splits = num_splits or decode_splits(seqs, nkv, q.device)
    dot_dtype, precision = dot_types(q)
    parts = lse = out  # unused with one partition
    if splits > 1:
        parts, lse = partials_buffers(seqs, nh, splits, head_pad, q.device)
    group = nh // nkv
    _decode_partition_kernel[(seqs, nkv, splits)](
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        out,
        parts,
        lse,
        scale,
        softcap,
        window,
        splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=hd,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile,
        MIN_TOKENS=MIN_PARTITION,
        SINGLE=splits == 1,
        USE_SOFTCAP=softcap > 0,
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        num_warps=warps,
    )
    if splits > 1:
        _decode_reduce_kernel[(seqs, nh)](
            parts,
            lse,
            lens,
            out,
            window,
            splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=hd,
            HEAD_PAD=head_pad,
            SPLITS_PAD=triton.next_power_of_2(splits),
            TILE_N=tile,
            MIN_TOKENS=MIN_PARTITION,
        )
