"""The paged attention backend: C++ kernels and torch fallback agree with a dense
float32 reference computed from the same keys and values, with and without a sliding
window and a logit softcap.

Three paths: "torch" (gathers, SDPA), "kernels" (what this CPU runs: the decode kernel,
and the prefill kernel where it is vectorised, else SDPA) and "prefill_kernel" (both
kernels, the prefill one even in its scalar build, so that its tiling and key ranges are
checked on any CPU); on an AVX-512 CPU a fourth, "kernels_avx2": the AVX2 build's decode
kernel, as a CPU without AVX-512 runs it."""

import pytest
import torch

from app.models import cpu_kernels
from app.models.attention import BatchLayout
from app.models.kernel_build import cpu_signature
from app.models.torch_attention import TorchPagedAttention
from tests.helpers import dense_reference

NKV, NH, HD, BS, NBLOCKS = 2, 6, 32, 4, 96
# Without AVX-512 the native build is the AVX2 one: a second is no news.
AVX512 = "avx512f" in cpu_signature().decode().split()
PATHS = ["torch", "kernels", "prefill_kernel", *(["kernels_avx2"] if AVX512 else [])]
WINDOWS = [0, 1, 5, 8]  # none; only itself; not a multiple of the block size; a multiple
SOFTCAPS = [0.0, 50.0]
# Three decodes; a chunk after a cached prefix; a chunk that spans two query tiles and
# several key chunks of the prefill kernel; a fresh prefill with nothing cached.
CONTEXTS, QUERIES, DECODES = [9, 14, 40, 11, 37, 7], [1, 1, 1, 5, 20, 7], 3


def make_backend(path: str, monkeypatch: pytest.MonkeyPatch) -> TorchPagedAttention:
    backend = TorchPagedAttention(torch.device("cpu"))
    if path == "torch":
        backend.kernels = None
    elif path == "kernels_avx2":  # compiled nowhere else on an AVX-512 CPU
        backend.kernels = cpu_kernels.load("avx2")
        kernels = backend.kernels
        assert kernels is not None and not kernels.has_prefill_kernel()
        assert kernels.reads_16_bit_cache_fast()  # the AVX2 code, not plain loops
    else:
        assert backend.kernels is not None, "C++ kernels failed to build"
    if path == "prefill_kernel":
        monkeypatch.setattr(TorchPagedAttention, "has_prefill_kernel", True)
    return backend


class Batch:
    """Sequences with random keys and values, the part before this step already cached."""

    def __init__(
        self, backend, contexts, queries, decodes, dtype, nkv=NKV, nh=NH, hd=HD, cache_dtype=None
    ):
        shape = backend.kv_cache_shape(NBLOCKS, BS, nkv, hd)
        cache_dtype = cache_dtype or dtype
        self.k_cache, self.v_cache = (
            torch.zeros(shape, dtype=cache_dtype),
            torch.zeros(shape, dtype=cache_dtype),
        )
        self.contexts, self.queries = contexts, queries
        free = torch.randperm(NBLOCKS).tolist()
        self.tables = [[free.pop() for _ in range(-(-c // BS))] for c in contexts]

        def rows(c: int) -> torch.Tensor:  # values the cache holds exactly
            return torch.randn(c, nkv, hd, dtype=cache_dtype).to(dtype)

        self.keys = [rows(c) for c in contexts]
        self.values = [rows(c) for c in contexts]
        slots = []
        for table, kk, vv, n in zip(self.tables, self.keys, self.values, queries, strict=True):
            ctx = kk.shape[0]
            for pos in range(ctx - n):
                self.k_cache[table[pos // BS], :, pos % BS] = kk[pos]
                self.v_cache[table[pos // BS], :, pos % BS] = vv[pos]
            slots += [table[p // BS] * BS + p % BS for p in range(ctx - n, ctx)]
        self.layout = BatchLayout(queries, contexts, self.tables, slots, decodes, BS)
        # Scores of a few units, so that a softcap of 50 changes them measurably.
        self.q = torch.randn(sum(queries), nh, hd, dtype=dtype) * 4
        self.new_k = torch.cat([kk[-n:] for kk, n in zip(self.keys, queries, strict=True)])
        self.new_v = torch.cat([vv[-n:] for vv, n in zip(self.values, queries, strict=True)])

    def poison_before_window(self, window: int) -> None:
        """NaN in every cached key and value older than the first one this step may see:
        a kernel that reads them, even to mask them, returns NaN."""
        for table, ctx, n in zip(self.tables, self.contexts, self.queries, strict=True):
            for pos in range(max(0, ctx - n - window + 1)):
                self.k_cache[table[pos // BS], :, pos % BS] = float("nan")
                self.v_cache[table[pos // BS], :, pos % BS] = float("nan")

    def run(self, backend, meta, window=0, softcap=0.0):
        scale = self.q.shape[-1] ** -0.5
        return backend.forward(
            self.q, self.new_k, self.new_v, self.k_cache, self.v_cache, meta, scale, window, softcap
        )

    def check(self, out, window=0, softcap=0.0):
        tol = 1e-5 if out.dtype == torch.float32 else 2e-2
        start = 0
        for kk, vv, c, n in zip(self.keys, self.values, self.contexts, self.queries, strict=True):
            ref = dense_reference(self.q[start : start + n], kk, vv, c - n, window, softcap)
            got = out[start : start + n].float()
            torch.testing.assert_close(
                got, ref, atol=tol, rtol=tol, msg=lambda m, i=start: f"{i}: {m}"
            )
            start += n


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_mixed_batch_matches_dense_attention(path, dtype, window, softcap, monkeypatch):
    torch.manual_seed(0)
    backend = make_backend(path, monkeypatch)
    batch = Batch(backend, CONTEXTS, QUERIES, DECODES, dtype)
    meta = backend.build_metadata(batch.layout, NKV, torch.device("cpu"))
    batch.check(batch.run(backend, meta, window, softcap), window, softcap)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (5, 50.0)])
def test_16_bit_cache_under_float32_queries(path, cache_dtype, window, softcap, monkeypatch):
    """kv_cache_dtype float16 or bfloat16 for a float32 model: float32 queries and
    outputs, keys and values read from 16-bit blocks; the reference sees the same
    (representable) keys, so only accumulation order separates them."""
    torch.manual_seed(5)
    backend = make_backend(path, monkeypatch)
    batch = Batch(backend, CONTEXTS, QUERIES, DECODES, torch.float32, cache_dtype=cache_dtype)
    meta = backend.build_metadata(batch.layout, NKV, torch.device("cpu"))
    out = batch.run(backend, meta, window, softcap)
    assert out.dtype == torch.float32 and batch.k_cache.dtype == cache_dtype
    batch.check(out, window, softcap)


@pytest.mark.parametrize("path", [p for p in PATHS if p.startswith("kernels")])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hd", [HD, 40])  # 40: a vectorised row store's scalar tail
def test_16_bit_cache_write_rounds_as_torch(path, cache_dtype, hd, monkeypatch):
    """Float32 keys stored in a 16-bit cache by the write kernel are torch's .to() of
    them, ties to even included; a NaN stays a NaN and infinities (and float16's
    overflows) stay infinite; nothing lands outside the named slots. (The torch path
    writes k.to(cache dtype) itself.)"""
    kernels = make_backend(path, monkeypatch).kernels
    shape = (8, NKV, BS, hd)
    k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    k, v = torch.randn(3, NKV, hd) * 100, torch.randn(3, NKV, hd)
    eps = torch.finfo(cache_dtype).eps  # 1 + eps / 2 and 1 + 3 eps / 2 are exact ties
    k[0, 0, :5] = torch.tensor([1 + eps / 2, 1 + 3 * eps / 2, -(1 + eps / 2), 2**-130, 1e6])
    k[1, 1, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    low_payload_nan = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)
    k[2, 0, -2:] = low_payload_nan  # in the tail when hd is not a multiple of 16
    slots = [5, 12, 31]
    kernels.write_kv_cache(k, v, k_cache, v_cache, torch.tensor(slots))
    for i, slot in enumerate(slots):
        got_k, got_v = k_cache[slot // BS, :, slot % BS], v_cache[slot // BS, :, slot % BS]
        want_k = k[i].to(cache_dtype)
        assert torch.equal(got_k.isnan(), want_k.isnan())
        assert torch.equal(got_k.nan_to_num(0.0), want_k.nan_to_num(0.0))
        assert torch.equal(got_v, v[i].to(cache_dtype))
    assert k_cache[1, 0, 1, :2].tolist() == [1, 1 + 2 * eps]  # slot 5: k[0], to even
    assert int((v_cache != 0).any(dim=-1).sum()) == 3 * NKV


@pytest.mark.parametrize("path", PATHS)
def test_one_metadata_serves_layers_of_different_windows(path, monkeypatch):
    """Gemma alternates sliding and global layers over the same forward's metadata."""
    torch.manual_seed(1)
    backend = make_backend(path, monkeypatch)
    batch = Batch(backend, CONTEXTS, QUERIES, DECODES, torch.float32)
    meta = backend.build_metadata(batch.layout, NKV, torch.device("cpu"))
    for window, softcap in [(5, 50.0), (0, 50.0), (5, 50.0), (8, 0.0), (0, 0.0)]:
        batch.check(batch.run(backend, meta, window, softcap), window, softcap)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("heads", [(1, 8), (4, 4), (2, 16)])
def test_grouped_query_heads(path, heads, monkeypatch):
    torch.manual_seed(2)
    nkv, nh = heads
    backend = make_backend(path, monkeypatch)
    batch = Batch(backend, [21, 30, 26], [1, 1, 9], 2, torch.float32, nkv=nkv, nh=nh, hd=64)
    meta = backend.build_metadata(batch.layout, nkv, torch.device("cpu"))
    batch.check(batch.run(backend, meta, 6, 50.0), 6, 50.0)


@pytest.mark.parametrize("window", [1, 5, 8])
def test_kernels_never_read_before_the_window(window, monkeypatch):
    """The point of a window on a paged cache: blocks wholly before it are not read."""
    torch.manual_seed(3)
    backend = make_backend("prefill_kernel", monkeypatch)
    batch = Batch(backend, CONTEXTS, QUERIES, DECODES, torch.float32)
    batch.poison_before_window(window)
    meta = backend.build_metadata(batch.layout, NKV, torch.device("cpu"))
    batch.check(batch.run(backend, meta, window), window)


def test_softcapped_prefill_in_query_tiles_matches(monkeypatch):
    """Long contexts split the capped prefill into query tiles (bounded score memory)."""
    from app.models import torch_attention

    monkeypatch.setattr(torch_attention, "SOFTCAP_SCORE_BYTES", 4 * NH * 40 * 3)  # 3 rows
    torch.manual_seed(4)
    backend = make_backend("torch", monkeypatch)
    batch = Batch(backend, CONTEXTS, QUERIES, DECODES, torch.float32)
    meta = backend.build_metadata(batch.layout, NKV, torch.device("cpu"))
    batch.check(batch.run(backend, meta, 5, 50.0), 5, 50.0)


def test_softcap_is_seen_by_these_tests():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, NH, HD) * 4, torch.randn(9, NKV, HD), torch.randn(9, NKV, HD)
    capped, plain = dense_reference(q, k, v, 6, softcap=50.0), dense_reference(q, k, v, 6)
    assert (capped - plain).abs().max() > 1e-3


@pytest.mark.parametrize("path", ["torch", "kernels"])
def test_cache_write_lands_in_the_named_slots(path, monkeypatch):
    backend = make_backend(path, monkeypatch)
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
