"""The FlashAttention backend's cache layout and metadata, checked on the CPU.

FlashAttention's kernels only run on CUDA, so here the backend gets reference kernels
that follow their documented semantics (paged K/V through a block table, `cache_seqlens`
/ `cu_seqlens_k` as the visible keys, a causal mask aligned bottom-right) and must agree
with a dense reference, as the torch backend does. The real kernels have never run here
(no GPU, and flash-attn cannot be installed on the project's GPU machine): a test of them
would only ever be skipped, so the GPU path's own tests come with issue 20."""

from types import SimpleNamespace

import pytest
import torch

from app.models.attention import BatchLayout
from app.models.attention_backends import select_backend
from app.models.flash_attention import FlashAttentionBackend
from tests.helpers import dense_reference

NKV, NH, HD, BS, NBLOCKS = 2, 6, 32, 256, 12


def _paged_keys(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    return cache[table.long()].reshape(-1, cache.shape[2], cache.shape[3])[:length]


def _attend(q, keys, values, scale, causal, window_size=(-1, -1), softcap=0.0):
    """q (Lq, nh, hd), keys (L, nkv, hd). As documented: a causal mask aligned bottom-right;
    window_size (left, right): query i sees keys i + L - Lq - left .. i + L - Lq + right."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).float()
    v = values.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    lq, lk = q.shape[0], keys.shape[0]
    diag = (lk - lq + torch.arange(lq))[:, None]  # the key aligned with each query
    j = torch.arange(lk)[None, :]
    visible = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        visible &= j <= diag
    left, right = window_size
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).to(q.dtype)


def ref_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, **kw):
    outs = []
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        keys = _paged_keys(k_cache, block_table[b], n)
        values = _paged_keys(v_cache, block_table[b], n)
        outs.append(_attend(q[b], keys, values, softmax_scale, causal, **kw))
    return torch.stack(outs)


def ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
    outs = []
    table, scale, causal = kw.pop("block_table"), kw.pop("softmax_scale"), kw.pop("causal")
    for b in range(len(cu_seqlens_q) - 1):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert hi - lo <= max_seqlen_q and n <= max_seqlen_k
        keys = _paged_keys(k, table[b], n)
        values = _paged_keys(v, table[b], n)
        outs.append(_attend(q[lo:hi], keys, values, scale, causal, **kw))
    return torch.cat(outs)


REFERENCE = SimpleNamespace(
    flash_attn_with_kvcache=ref_with_kvcache, flash_attn_varlen_func=ref_varlen
)


def run_batch(backend, device, dtype, window=0, softcap=0.0):
    """Two decodes (contexts 300 and 700) and a 40-token chunk after 480 cached tokens."""
    torch.manual_seed(0)
    shape = backend.kv_cache_shape(NBLOCKS, BS, NKV, HD)
    k_cache = torch.zeros(shape, dtype=dtype, device=device)
    v_cache = torch.zeros(shape, dtype=dtype, device=device)
    contexts, queries = [300, 700, 520], [1, 1, 40]
    free = torch.randperm(NBLOCKS).tolist()
    tables = [[free.pop() for _ in range(-(-c // BS))] for c in contexts]
    keys = [torch.randn(c, NKV, HD, dtype=dtype, device=device) for c in contexts]
    values = [torch.randn(c, NKV, HD, dtype=dtype, device=device) for c in contexts]
    for table, kk, vv in zip(tables, keys, values, strict=True):
        for pos in range(kk.shape[0]):  # the already-cached part, in this backend's layout
            k_cache[table[pos // BS], pos % BS] = kk[pos]
            v_cache[table[pos // BS], pos % BS] = vv[pos]
    slots = []
    for table, ctx, n in zip(tables, contexts, queries, strict=True):
        slots += [table[p // BS] * BS + p % BS for p in range(ctx - n, ctx)]
    layout = BatchLayout(queries, contexts, tables, slots, num_decodes=2, block_size=BS)
    meta = backend.build_metadata(layout, NKV, device)
    q = torch.randn(sum(queries), NH, HD, dtype=dtype, device=device)
    new_k = torch.cat([kk[c - n :] for kk, c, n in zip(keys, contexts, queries, strict=True)])
    new_v = torch.cat([vv[c - n :] for vv, c, n in zip(values, contexts, queries, strict=True)])
    k_cache.view(-1, NKV, HD)[torch.tensor(slots)] = 0  # the step must write them itself
    out = backend.forward(q, new_k, new_v, k_cache, v_cache, meta, HD**-0.5, window, softcap)
    start, refs = 0, []
    for kk, vv, c, n in zip(keys, values, contexts, queries, strict=True):
        qs, kk, vv = q[start : start + n].cpu(), kk.cpu(), vv.cpu()
        if window or softcap:
            refs.append(dense_reference(qs, kk, vv, c - n, window, softcap))
        else:
            refs.append(dense_reference(qs, kk, vv, c - n))
        start += n
    return out.float().cpu(), torch.cat(refs)


def test_layout_and_metadata_match_dense_attention():
    backend = FlashAttentionBackend(BS, kernels=REFERENCE)
    out, ref = run_batch(backend, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_window_and_softcap_reach_the_kernels_as_documented():
    """window_size=(window - 1, 0) is the promised window; softcap passes as is. The chunk's
    first queries see keys before it (window 37 > 0), its last ones only the chunk."""
    backend = FlashAttentionBackend(BS, kernels=REFERENCE)
    out, ref = run_batch(backend, torch.device("cpu"), torch.float32, window=37, softcap=2.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_block_size_must_suit_the_paged_kernels():
    with pytest.raises(ValueError, match="multiple of 256"):
        FlashAttentionBackend(16, kernels=REFERENCE)


def test_selection_without_cuda_or_flash_attn():
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu, 256).name == "torch"
    with pytest.raises(ValueError, match="needs CUDA"):
        select_backend("flash", cpu, 256)


def test_decode_metadata_of_full_width_tables_matches_build_metadata():
    """What DecodeGraphs hands the backend: tables as wide as the model's context, read
    only up to each length."""
    backend = FlashAttentionBackend(BS, kernels=REFERENCE)
    torch.manual_seed(0)
    shape = backend.kv_cache_shape(NBLOCKS, BS, NKV, HD)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    contexts = [300, 700]
    tables = [[3, 5], [1, 0, 7]]
    slots = [t[(c - 1) // BS] * BS + (c - 1) % BS for t, c in zip(tables, contexts, strict=True)]
    layout = BatchLayout([1, 1], contexts, tables, slots, num_decodes=2, block_size=BS)
    q, k, v = torch.randn(2, NH, HD), torch.randn(2, NKV, HD), torch.randn(2, NKV, HD)
    meta = backend.build_metadata(layout, NKV, torch.device("cpu"))
    want = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, HD**-0.5)
    wide = torch.full((2, NBLOCKS), 11, dtype=torch.int32)  # past each length: any block
    wide[0, :2], wide[1, :3] = torch.tensor([3, 5]), torch.tensor([1, 0, 7])
    static = backend.decode_metadata(
        torch.tensor(slots), wide, torch.tensor(contexts, dtype=torch.int32)
    )
    got = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), static, HD**-0.5)
    torch.testing.assert_close(got, want)
