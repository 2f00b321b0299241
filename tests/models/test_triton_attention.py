"""The Triton backend (app/models/triton_kernels) against a dense float32 reference and
the torch backend: decode split over the context, GQA, head dims that are not powers of
two, sliding windows, softcaps, 16-bit caches and models, prefill after a cached prefix,
the cache write, graph-style decode metadata, and an engine end to end.

Without CUDA the kernels run in Triton's interpreter, chosen when a kernel is decorated:
TRITON_INTERPRET is set before anything imports them (tests/conftest.py, and here for a
run of this file alone). The interpreter runs one program
at a time, so shapes stay small; on a GPU host the same tests run the compiled kernels."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from app.engine.config import EngineConfig  # noqa: E402
from app.engine.model_runner import kv_cache_dtype  # noqa: E402
from app.models.attention import BatchLayout  # noqa: E402
from app.models.attention_backends import select_backend  # noqa: E402
from app.models.torch_attention import TorchPagedAttention  # noqa: E402
from app.models.triton_attention import TritonPagedAttention  # noqa: E402
from app.models.triton_kernels import decode, split_count  # noqa: E402
from app.models.triton_kernels.common import float32_products_on_gpu  # noqa: E402
from app.protocol import SamplingParams  # noqa: E402
from tests.helpers import dense_reference, save_tiny_checkpoint, tiny_engine  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NKV, NH, HD, BS, NBLOCKS = 2, 4, 64, 16, 48
# Four decode partitions of at least 64 tokens (decode.MIN_PARTITION): a 250-token
# context fills all four, a 100-token one two, so split-K runs at small sizes.
SPLITS = 4


class Batch:
    """Sequences with random keys and values on DEVICE, the part before this step cached.
    `queries[i]` tokens of context `contexts[i]` are this step's; the first `decodes` are
    single-token decodes."""

    def __init__(
        self,
        contexts: list[int],
        queries: list[int],
        decodes: int,
        dtype: torch.dtype = torch.float32,
        cache_dtype: torch.dtype | None = None,
        nkv: int = NKV,
        nh: int = NH,
        hd: int = HD,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        cache_dtype = cache_dtype or dtype
        shape = (NBLOCKS, nkv, BS, hd)
        self.k_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
        self.v_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
        self.contexts, self.queries = contexts, queries
        free = torch.randperm(NBLOCKS, generator=gen).tolist()
        self.tables = [[free.pop() for _ in range(-(-c // BS))] for c in contexts]

        def rows(c: int) -> torch.Tensor:  # values the cache holds exactly
            return torch.randn(c, nkv, hd, generator=gen).to(cache_dtype).to(dtype)

        self.keys = [rows(c) for c in contexts]
        self.values = [rows(c) for c in contexts]
        slots = []
        for table, kk, vv, n in zip(self.tables, self.keys, self.values, queries, strict=True):
            for pos in range(kk.shape[0] - n):
                self.k_cache[table[pos // BS], :, pos % BS] = kk[pos].to(DEVICE)
                self.v_cache[table[pos // BS], :, pos % BS] = vv[pos].to(DEVICE)
            slots += [table[p // BS] * BS + p % BS for p in range(kk.shape[0] - n, kk.shape[0])]
        self.layout = BatchLayout(queries, contexts, self.tables, slots, decodes, BS)
        # Scores of a few units, so that a softcap of 30 changes them measurably.
        self.q = (torch.randn(sum(queries), nh, hd, generator=gen) * 4).to(dtype)
        self.new_k = torch.cat([kk[-n:] for kk, n in zip(self.keys, queries, strict=True)])
        self.new_v = torch.cat([vv[-n:] for vv, n in zip(self.values, queries, strict=True)])

    def run(self, backend, meta=None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        if meta is None:
            meta = backend.build_metadata(self.layout, self.k_cache.shape[1], DEVICE)
        q, k, v = (x.to(DEVICE) for x in (self.q, self.new_k, self.new_v))
        scale = self.q.shape[-1] ** -0.5
        out = backend.forward(q, k, v, self.k_cache, self.v_cache, meta, scale, window, softcap)
        assert out.dtype == self.q.dtype and out.shape == self.q.shape
        return out.cpu()

    def check(self, out: torch.Tensor, window: int = 0, softcap: float = 0.0) -> None:
        tol = 2e-5 if out.dtype == torch.float32 else 2e-2
        start = 0
        for kk, vv, c, n in zip(self.keys, self.values, self.contexts, self.queries, strict=True):
            ref = dense_reference(self.q[start : start + n], kk, vv, c - n, window, softcap)
            got = out[start : start + n].float()
            torch.testing.assert_close(
                got, ref, atol=tol, rtol=tol, msg=lambda m, i=start: f"{i}: {m}"
            )
            start += n

    def poison_before_window(self, window: int) -> None:
        """NaN in every cached key and value older than the first one this step may see:
        a kernel that reads them, even to mask them, returns NaN."""
        for table, ctx, n in zip(self.tables, self.contexts, self.queries, strict=True):
            for pos in range(max(0, ctx - n - window + 1)):
                self.k_cache[table[pos // BS], :, pos % BS] = float("nan")
                self.v_cache[table[pos // BS], :, pos % BS] = float("nan")


def triton_backend(num_splits: int = SPLITS) -> TritonPagedAttention:
    return TritonPagedAttention(num_splits=num_splits)


@pytest.fixture
def partials(monkeypatch) -> list[torch.Tensor]:
    """Decode's partials buffers filled with NaN, not left uninitialised: a partition
    that stage 2 reads but stage 1 skipped turns the output NaN. Each launch's
    log-sum-exp buffer, (S, nh, splits), is kept for `live_partitions`."""
    made = []

    def nan_buffers(seqs, nh, splits, head_pad, device):
        parts = torch.full((seqs, nh, splits, head_pad), float("nan"), device=device)
        lse = torch.full((seqs, nh, splits), float("nan"), device=device)
        made.append(lse)
        return parts, lse

    monkeypatch.setattr(decode, "partials_buffers", nan_buffers)
    return made


def live_partitions(lse: torch.Tensor) -> list[int]:
    """The partitions stage 1 wrote, per sequence (every head of a sequence alike)."""
    counts = (~lse.isnan()).sum(-1).cpu()  # (S, nh)
    assert torch.equal(counts, counts[:, :1].expand_as(counts))
    return counts[:, 0].tolist()


# ---- decode ----------------------------------------------------------------------------
@pytest.mark.parametrize("heads", [(2, 4), (2, 2)], ids=["gqa", "mha"])
def test_triton_decode_at_several_lengths(heads, partials):
    """1 token; a block and one past it; partial blocks. Four partitions of 64 tokens:
    250 tokens fill them all; 100 fill two, the other two empty; 17 or fewer fill one."""
    nkv, nh = heads
    batch = Batch([1, 16, 17, 100, 250], [1] * 5, 5, nkv=nkv, nh=nh)
    batch.check(batch.run(triton_backend()))
    assert [lse.shape for lse in partials] == [(5, nh, SPLITS)]
    assert live_partitions(partials[0]) == [1, 1, 1, 2, 4]


def test_triton_decode_partitions_longer_than_the_minimum(partials):
    """Three partitions (not a power of two): 500 tokens cut into 192-token runs of three
    tiles each, the last one short; 200 tokens into two runs of 128, the third empty.
    (On a GPU float32 takes 32-key tiles: runs of 96, all three live for 200 tokens.)"""
    batch = Batch([200, 500], [1, 1], 2, seed=11)
    batch.check(batch.run(triton_backend(3)))
    narrow = float32_products_on_gpu(batch.q.to(DEVICE))
    assert live_partitions(partials[0]) == ([3, 3] if narrow else [2, 3])


def test_triton_decode_in_one_partition_writes_the_output_itself(partials):
    batch = Batch([9, 40, 150], [1, 1, 1], 3)
    batch.check(batch.run(triton_backend(1)))
    assert partials == []  # no partials, no reduce: stage 1 stored the output


@pytest.mark.parametrize(
    ("window", "softcap", "live"),
    [
        (1, 0.0, [1, 1, 1]),
        (70, 0.0, [2, 1, 2]),
        (0, 30.0, [4, 1, 2]),
        (70, 30.0, [2, 1, 2]),
        (150, 0.0, [3, 1, 2]),
    ],
)
def test_triton_decode_window_and_softcap(window, softcap, live, partials):
    """Only the visible span is cut: window 70 on 250 tokens leaves keys 180..249, from
    the tile at 128, in two partitions, the last two empty; window 150 starts partition 0
    at 64 (keys 64..99 masked, poisoned: a read of them is NaN) and fills three."""
    batch = Batch([250, 30, 100], [1, 1, 1], 3, seed=1)
    batch.poison_before_window(window or 10**6)
    batch.check(batch.run(triton_backend(), window=window, softcap=softcap), window, softcap)
    assert live_partitions(partials[0]) == live


def test_triton_decode_metadata_matches_build_metadata(partials):
    """The graph-capture path: device tensors as they are, tables 64 blocks wide (a
    captured graph's width, wider than the cache itself) past short contexts, the spare
    entries naming a NaN block. The same partitions, buffers and output as tables cut to
    each context: the launch never depends on the tables' width."""
    batch = Batch([1, 33, 150], [1, 1, 1], 3, seed=2)
    backend = triton_backend()
    built = batch.run(backend)
    spare = min(set(range(NBLOCKS)) - {b for table in batch.tables for b in table})
    batch.k_cache[spare] = float("nan")
    batch.v_cache[spare] = float("nan")
    tables = torch.full((3, 64), spare, dtype=torch.int32)
    for i, table in enumerate(batch.tables):
        tables[i, : len(table)] = torch.tensor(table)
    lens = torch.tensor(batch.contexts, dtype=torch.int32)
    meta = backend.decode_metadata(
        batch.layout.slot_mapping.to(DEVICE), tables.to(DEVICE), lens.to(DEVICE)
    )
    torch.testing.assert_close(batch.run(backend, meta), built, atol=1e-6, rtol=1e-6)
    batch.check(built)
    assert [lse.shape for lse in partials] == [(3, NH, SPLITS)] * 2
    assert live_partitions(partials[0]) == live_partitions(partials[1]) == [1, 1, 3]


def test_triton_decode_split_policy():
    """From the launch shape alone: about two stage-1 programs per SM (132 on an H100),
    at most 16 partitions, one once the batch fills the GPU; a fixed count off CUDA."""
    assert split_count(1, 8, 132) == 16
    assert split_count(4, 8, 132) == 9  # 4 * 8 * 9 = 288 programs
    assert split_count(16, 8, 132) == 3
    assert split_count(256, 8, 132) == 1
    assert decode.decode_splits(256, 8, torch.device("cpu")) == decode.INTERPRETER_SPLITS


# ---- prefill ---------------------------------------------------------------------------
def test_triton_prefill_without_prefix():
    """Fresh prompts: one of two query tiles of 32 tokens (64 rows, 2 heads a kv head)."""
    batch = Batch([70, 9], [70, 9], 0, seed=3)
    batch.check(batch.run(triton_backend()))


def test_triton_prefill_after_cached_prefix():
    """Extend: chunks read their cached prefix in place through the block table."""
    batch = Batch([90, 40], [20, 1 + 6], 0, seed=4)
    batch.check(batch.run(triton_backend()))


@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (0, 30.0), (37, 30.0)])
def test_triton_prefill_window_and_softcap(window, softcap):
    batch = Batch([100, 20], [40, 20], 0, seed=5)
    batch.poison_before_window(window or 10**6)
    batch.check(batch.run(triton_backend(), window=window, softcap=softcap), window, softcap)


def test_triton_mixed_batch_matches_torch_backend():
    """Decodes first, then a chunk after a prefix and a fresh prompt, in one output; the
    torch backend (its CPU kernels) on the same cache gives the same numbers."""
    contexts, queries = [150, 7, 60, 12], [1, 1, 25, 12]
    batch = Batch(contexts, queries, 2, seed=6)
    out = batch.run(triton_backend(), window=0, softcap=30.0)
    batch.check(out, 0, 30.0)
    reference = Batch(contexts, queries, 2, seed=6)
    torch_backend = TorchPagedAttention(DEVICE)
    expected = reference.run(torch_backend, window=0, softcap=30.0)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(batch.k_cache, reference.k_cache, atol=0, rtol=0)


# ---- head dims, GQA, dtypes ------------------------------------------------------------
@pytest.mark.parametrize("hd", [64, 96, 128, 256])
def test_triton_head_dims(hd):
    """96 pads to 128 with masks; 256 takes the narrower key tiles."""
    batch = Batch([70, 20], [1, 6], 1, hd=hd, seed=7)
    batch.check(batch.run(triton_backend(), window=50, softcap=30.0), 50, 30.0)


@pytest.mark.parametrize("heads", [(1, 8), (2, 6)], ids=["group8", "group3"])
def test_triton_grouped_heads(heads):
    """A group of 8 on one kv head; 3 (not a power of two: 21 tokens a prefill tile)."""
    nkv, nh = heads
    batch = Batch([80, 30], [1, 30], 1, nkv=nkv, nh=nh, seed=8)
    batch.check(batch.run(triton_backend()))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_triton_16_bit_cache_under_float32_model(cache_dtype):
    """float32 queries and outputs, keys and values read from 16-bit blocks."""
    batch = Batch([100, 30, 20], [1, 1, 12], 2, cache_dtype=cache_dtype, seed=9)
    out = batch.run(triton_backend(), window=40, softcap=30.0)
    assert out.dtype == torch.float32 and batch.k_cache.dtype == cache_dtype
    batch.check(out, 40, 30.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_16_bit_model(dtype):
    """A 16-bit model: the output in its dtype, within its rounding of the reference."""
    batch = Batch([100, 30, 20], [1, 1, 12], 2, dtype=dtype, seed=10)
    out = batch.run(triton_backend())
    assert out.dtype == dtype
    batch.check(out)


# ---- cache write -----------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_cache_write_is_exact(cache_dtype):
    """float32 keys land in their slots as torch's .to() rounds them (ties to even), a
    NaN stays NaN, a slot of -1 is skipped, nothing else is touched; a 96-wide head (not
    a power of two) leaves the next head's values alone. k and v are strided views, as
    the model's qkv projection gives them."""
    backend = triton_backend()
    hd = 96
    shape = (8, NKV, BS, hd)
    k_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
    v_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
    qkv = torch.randn(4, (NH + 2 * NKV) * hd) * 100
    k = qkv[:, NH * hd : (NH + NKV) * hd].view(4, NKV, hd)
    v = qkv[:, (NH + NKV) * hd :].view(4, NKV, hd)
    if cache_dtype != torch.float32:
        eps = torch.finfo(cache_dtype).eps  # 1 + eps / 2 and 1 + 3 eps / 2 are exact ties
        k[0, 0, :3] = torch.tensor([1 + eps / 2, 1 + 3 * eps / 2, -(1 + eps / 2)])
    k[1, 1, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    slots = torch.tensor([5, 12, -1, 31])  # -1: a padding token, written nowhere
    backend.kernels.write_kv_cache(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        got_k, want_k = k_cache[slot // BS, :, slot % BS], k[i].to(cache_dtype)
        assert torch.equal(got_k.isnan(), want_k.isnan())
        assert torch.equal(got_k.nan_to_num(0.0), want_k.nan_to_num(0.0))
        assert torch.equal(v_cache[slot // BS, :, slot % BS], v[i].to(cache_dtype))
    if cache_dtype != torch.float32:
        eps = torch.finfo(cache_dtype).eps
        assert k_cache[0, 0, 5, :3].tolist() == [1, 1 + 2 * eps, -1]  # to even
    assert int((v_cache != 0).any(dim=-1).sum()) == 3 * NKV


# ---- selection, cache dtype, engine ----------------------------------------------------
def test_triton_selection(monkeypatch):
    assert select_backend("triton", DEVICE).name == "triton"
    if DEVICE.type == "cuda":
        assert select_backend("auto", DEVICE, 16).name == "triton"  # flash needs 256
        return
    assert select_backend("auto", DEVICE).name == "torch"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_backend("triton", DEVICE)


def test_triton_allows_a_16_bit_cache_under_float32():
    config = EngineConfig(dtype="float32", kv_cache_dtype="bfloat16", attention_backend="triton")

    class Loaded:
        dtype = torch.float32

    assert kv_cache_dtype(config, Loaded(), triton_backend()) == torch.bfloat16


def test_triton_engine_matches_torch_backend(tmp_path):
    """Greedy tokens of a tiny float32 Llama (head dim 64, two query heads on one kv head)
    are the torch backend's: prefill, then decodes over blocks of 4 tokens."""
    checkpoint = save_tiny_checkpoint(
        tmp_path / "tiny", hidden_size=128, num_attention_heads=2, num_key_value_heads=1
    )
    prompts = [[1, 17, 42, 99, 7], [3, 8, 120, 64, 33, 12, 5, 200, 9]]
    params = SamplingParams(temperature=0, max_tokens=4)
    tokens = {}
    for name in ("triton", "torch"):
        engine = tiny_engine(checkpoint, attention_backend=name)
        assert engine.runner.backend.name == name
        tokens[name] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 4 for t in tokens["torch"])
