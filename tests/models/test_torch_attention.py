"""The paged attention backend: C++ decode kernel and torch fallback agree with a
dense reference computed from the same keys and values."""

import pytest
import torch

from app.models.attention import BatchLayout
from app.models.torch_attention import TorchPagedAttention
from tests.helpers import dense_reference

NKV, NH, HD, BS, NBLOCKS = 2, 6, 32, 4, 64


def make_backend(use_kernels: bool) -> TorchPagedAttention:
    backend = TorchPagedAttention(torch.device("cpu"))
    if not use_kernels:
        backend.kernels = None
    else:
        assert backend.kernels is not None, "C++ kernels failed to build"
    return backend


@pytest.mark.parametrize("use_kernels", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_dense_attention(use_kernels: bool, dtype: torch.dtype):
    torch.manual_seed(0)
    backend = make_backend(use_kernels)
    shape = backend.kv_cache_shape(NBLOCKS, BS, NKV, HD)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    # Three sequences: two decodes (contexts 9 and 14), one prefill chunk of 5 after 6 cached.
    contexts, queries = [9, 14, 11], [1, 1, 5]
    free = torch.randperm(NBLOCKS).tolist()
    tables = [[free.pop() for _ in range(-(-c // BS))] for c in contexts]
    keys = [torch.randn(c, NKV, HD, dtype=dtype) for c in contexts]
    values = [torch.randn(c, NKV, HD, dtype=dtype) for c in contexts]
    for table, kk, vv in zip(tables, keys, values, strict=True):  # the already-cached part
        for pos in range(kk.shape[0]):
            k_cache[table[pos // BS], :, pos % BS] = kk[pos]
            v_cache[table[pos // BS], :, pos % BS] = vv[pos]
    slots = []
    for table, ctx, n in zip(tables, contexts, queries, strict=True):
        slots += [table[p // BS] * BS + p % BS for p in range(ctx - n, ctx)]
    layout = BatchLayout(queries, contexts, tables, slots, num_decodes=2, block_size=BS)
    meta = backend.build_metadata(layout, NKV, torch.device("cpu"))
    q = torch.randn(sum(queries), NH, HD, dtype=dtype)
    new_k = torch.cat([kk[c - n :] for kk, c, n in zip(keys, contexts, queries, strict=True)])
    new_v = torch.cat([vv[c - n :] for vv, c, n in zip(values, contexts, queries, strict=True)])
    out = backend.forward(q, new_k, new_v, k_cache, v_cache, meta, HD**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    start = 0
    for kk, vv, c, n in zip(keys, values, contexts, queries, strict=True):
        ref = dense_reference(q[start : start + n], kk, vv, c - n)
        torch.testing.assert_close(out[start : start + n].float(), ref, atol=tol, rtol=tol)
        start += n


@pytest.mark.parametrize("use_kernels", [True, False])
def test_cache_write_lands_in_the_named_slots(use_kernels: bool):
    backend = make_backend(use_kernels)
    shape = backend.kv_cache_shape(8, BS, NKV, HD)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    k, v = torch.randn(3, NKV, HD), torch.randn(3, NKV, HD)
    slots = [5, 12, 31]
    layout = BatchLayout([3], [3], [[1, 3, 7]], slots, num_decodes=0, block_size=BS)
    meta = backend.build_metadata(layout, NKV, torch.device("cpu"))
    backend.forward(torch.randn(3, NH, HD), k, v, k_cache, v_cache, meta, 1.0)
    for i, slot in enumerate(slots):
        torch.testing.assert_close(k_cache[slot // BS, :, slot % BS], k[i])
        torch.testing.assert_close(v_cache[slot // BS, :, slot % BS], v[i])
    assert int((k_cache != 0).any(dim=-1).sum()) == 3 * NKV
