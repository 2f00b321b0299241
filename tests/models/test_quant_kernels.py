"""Quantised-weight kernels (app/models/quant) against gguf's exact dequantisation.

The reference multiplies gguf's own float32 dequantisation of the same rows in float64, so
the only tolerance is accumulation order (float32 outputs) plus one output rounding
(bfloat16 outputs), measured against sum |x| |w| (the scale of a dot product's rounding).
Where the GEMV rounds x to int8 (gemv_i8.h), the reference rounds x the same way first
(rounded_x), so the tolerance stays the same.
"""

import functools

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize

from app.models import quant
from app.models.kernel_build import cpu_signature
from app.models.quant import QuantType, dequantize, dequantize_packed, pack, unpack

TYPES = list(QuantType)
INT8_TYPES = [QuantType.Q4_0, QuantType.Q4_1, QuantType.Q8_0, QuantType.Q4_K]  # gemv_i8.h's
FLOAT, INT8 = 1, 2  # quant_matmul's activations argument
SHAPE = (577, 768)  # N odd; K a multiple of 256 (every type) but not of 512
ACCUMULATION = 1e-5  # float32 sums of <= a few thousand terms, in any order
BF16_ROUNDING = 2.0**-8  # one rounding to bfloat16 (2^-9), with margin


@pytest.fixture(scope="module")
def kernels():
    # setup.sh installs ninja and the machine has a compiler: the kernels must build.
    module = quant.load()
    assert module is not None, "quantised-weight kernels failed to build"
    return module


# Without AVX-512 the native build is the AVX2 one (or there is none): a second is no news.
AVX512 = "avx512f" in cpu_signature().decode().split()


@pytest.fixture(scope="module", params=["native", "avx2"] if AVX512 else ["native"])
def built(request, kernels):
    """The tests of the integer GEMV run on the native build and, on an AVX-512 CPU, on
    the AVX2 build too: with VNNI its code is compiled nowhere else (quant/__init__.py)."""
    if request.param == "native":
        return kernels
    module = quant.load("avx2")
    assert module is not None and module.isa() == "avx2"
    return module


@functools.cache
def weights(qtype: QuantType, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw GGUF rows, their float32 dequantisation). Row 0 is all zeros (zero scales)."""
    rng = np.random.default_rng(int(qtype) * 1000 + n + k)
    if qtype in (QuantType.Q4_0, QuantType.Q4_1, QuantType.Q8_0):
        w = rng.standard_normal((n, k)).astype(np.float32) * rng.random((n, 1)).astype(np.float32)
        w[0] = 0
        raw = torch.from_numpy(quantize(w, GGMLQuantizationType(qtype.value)))
    else:  # gguf has no numpy quantiser for the K types: random bytes, finite fp16 scales
        blocks = n * k // 256
        b = rng.integers(0, 256, size=(blocks, qtype.block_bytes), dtype=np.uint8)
        halves = (rng.random((blocks, 2)) * 0.02).astype(np.float16).view(np.uint8)
        if qtype in (QuantType.Q4_K, QuantType.Q5_K):
            b[:, 0:4] = halves  # d, dmin
        else:
            b[:, 208:210] = halves[:, :2]  # d (int8 scales stay random, signs included)
        raw = torch.from_numpy(b.reshape(n, -1))
    return raw, dequantize(raw, qtype, k)


def rounded_x(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 GEMV sees it (quantize_x.h), in the same float32 operations: per
    32-block d = max|x| / 127 and q = round(x * (127 / max|x|)), ties to even."""
    blocks = x.float().reshape(x.shape[0], -1, 32)  # (T, K / 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # tensor / tensor: torch turns a scalar operand into a multiply by its reciprocal
    k127 = torch.full_like(amax, 127)
    inverse = torch.where(amax != 0, k127 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse)
    return (q.double() * (amax / k127).double()).reshape(x.shape)


def seen_x(kernels, qtype: QuantType, x: torch.Tensor) -> torch.Tensor:
    """What quant.matmul multiplies: x rounded wherever the type has an int8 GEMV, the
    tiles included (so results do not depend on which path a step's size picks)."""
    int8 = qtype in INT8_TYPES and not quant.float_activations
    return rounded_x(x) if int8 else x.float()


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    xd = x.double()
    ref = xd @ w.double().T
    scale = xd.abs() @ w.double().abs().T
    tol = ACCUMULATION * scale
    if out.dtype == torch.bfloat16:
        tol = tol + BF16_ROUNDING * ref.abs()
    err = (out.double() - ref).abs()
    worst = (err - tol).argmax()
    assert (err <= tol).all(), (
        f"error {err.flatten()[worst]:.3g} over tolerance {tol.flatten()[worst]:.3g}"
    )


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_packing_is_lossless_and_small(qtype):
    raw, w = weights(qtype, *SHAPE)
    packed = pack(raw, qtype)
    assert torch.equal(unpack(packed), raw)
    assert torch.equal(dequantize_packed(packed), w)
    padded = -(-raw.shape[0] // 4) * 4  # rows go in groups of four
    expected = padded * raw.shape[1]
    if qtype in (QuantType.Q4_K, QuantType.Q5_K):  # 6-bit scales and mins get a byte each
        expected = expected // qtype.block_bytes * (qtype.block_bytes + 4)
    assert packed.nbytes == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t", [1, 2, 3, 7, 16, 33, 64])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_matmul_into_a_column_slice(kernels, qtype, t, dtype):
    n, k = SHAPE
    raw, w = weights(qtype, n, k)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to(dtype)
    fused = torch.full((t, n + 40), float("nan"), dtype=dtype)  # q/k/v-style fused output
    out = quant.matmul(x, pack(raw, qtype), out=fused[:, 24 : 24 + n])
    assert out.data_ptr() == fused[:, 24:].data_ptr()
    check(out, seen_x(kernels, qtype, x), w)
    assert fused[:, :24].isnan().all() and fused[:, 24 + n :].isnan().all()


@pytest.mark.parametrize("mode", [1, 2], ids=["gemv", "tiles"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_both_regimes_at_any_t(built, qtype, mode):
    n, k = 1536, 512
    raw, w = weights(qtype, n, k)
    packed = pack(raw, qtype)
    for t in (1, 9, 33):
        x = torch.randn(t, k)
        out = torch.empty(t, n)
        built.quant_matmul(x, int(qtype), list(packed.parts), n, k, out, mode, 48, FLOAT)
        check(out, x, w)


@pytest.mark.parametrize("t", range(1, 17))
@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda q: q.name)
def test_int8_gemv_is_exact_on_rounded_x(built, qtype, t):
    n, k = SHAPE
    raw, w = weights(qtype, n, k)
    packed = pack(raw, qtype)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(100 + t)) * 3
    x[:, 32:64] = 0  # a block of zeros: d = 0
    for dtype in (torch.float32, torch.bfloat16) if t in (1, 5) else (torch.float32,):
        out = torch.empty(t, n, dtype=dtype)
        built.quant_matmul(x, int(qtype), list(packed.parts), n, k, out, 1, 0, INT8)
        check(out, rounded_x(x), w)


@pytest.mark.parametrize(
    "qtype", [QuantType.Q4_0, QuantType.Q4_1, QuantType.Q8_0], ids=lambda q: q.name
)
def test_int8_gemv_of_short_rows(built, qtype):
    """Rows of 3 and 5 blocks (the VNNI nibble pass's scales are interleaved 4 blocks at a
    time, gemv.h, then one by one) and 11 row groups (units of 4, 4 and 3): exact, and
    each row the same bits alone as in the batch."""
    for n, k in ((44, 96), (44, 160)):
        _short_rows(built, qtype, n, k)


def _short_rows(built, qtype: QuantType, n: int, k: int) -> None:
    raw, w = weights(qtype, n, k)
    qt, parts = pack(raw, qtype).kernel_args
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(9)) * 3
    out = torch.empty(9, n)
    built.quant_matmul(x, qt, parts, n, k, out, 0, 0, INT8)
    check(out, rounded_x(x), w)
    for i in range(9):
        row = torch.empty(1, n)
        built.quant_matmul(x[i : i + 1], qt, parts, n, k, row, 0, 0, INT8)
        assert torch.equal(row[0], out[i]), i


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda q: q.name)
def test_int8_gemv_of_long_rows(built, qtype):
    """Rows of 32 blocks and more: exact (the VNNI pass adds the Q4 offsets inside it, the
    AVX2 pass after it; gemv_i8.h)."""
    n, k = 64, 1536
    raw, w = weights(qtype, n, k)
    packed = pack(raw, qtype)
    for t in (1, 4, 8, 13):
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)) * 3
        out = torch.empty(t, n)
        built.quant_matmul(x, int(qtype), list(packed.parts), n, k, out, 1, 0, INT8)
        check(out, rounded_x(x), w)


def test_int8_activations_are_a_choice(built):
    # auto: int8 where the type has an integer kernel; float where it has none (Q6_K)
    n, k = SHAPE
    x = torch.randn(2, k)
    for qtype, auto_rounds in ((QuantType.Q4_1, True), (QuantType.Q6_K, False)):
        raw, w = weights(qtype, n, k)
        parts = list(pack(raw, qtype).parts)
        out = torch.empty(2, n)
        built.quant_matmul(x, int(qtype), parts, n, k, out, 1, 0, 0)
        check(out, rounded_x(x) if auto_rounds else x, w)
        built.quant_matmul(x, int(qtype), parts, n, k, out, 1, 0, FLOAT)
        check(out, x, w)
    with pytest.raises(RuntimeError, match="no int8-activation kernel"):
        built.quant_matmul(x, int(QuantType.Q6_K), parts, n, k, out, 1, 0, INT8)


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda q: q.name)
def test_tiles_round_x_as_the_int8_gemv_does(built, qtype):
    # a row's result must not depend on the path its step's size picks: a prefix-cache hit
    # or a short prefill chunk takes the GEMV, a long prompt the tiles
    n, k = SHAPE
    raw, _ = weights(qtype, n, k)
    parts = list(pack(raw, qtype).parts)
    x = torch.randn(5, k) * 3
    gemv, tiles = torch.empty(5, n), torch.empty(5, n)
    built.quant_matmul(x, int(qtype), parts, n, k, gemv, 1, 0, 0)
    built.quant_matmul(x, int(qtype), parts, n, k, tiles, 2, 0, 0)
    assert torch.allclose(gemv, tiles, rtol=1e-5, atol=1e-4 * float(gemv.abs().max()))


def test_float_activations_switch(kernels, monkeypatch):
    monkeypatch.setattr(quant, "float_activations", True)
    raw, w = weights(QuantType.Q8_0, *SHAPE)
    x = torch.randn(1, SHAPE[1])
    check(quant.matmul(x, pack(raw, QuantType.Q8_0)), x, w)


def test_tiles_under_inference_mode(kernels):
    # the engine's forward runs in inference mode; the tile path's worker threads call
    # at::mm_out into the caller's (inference) output
    raw, w = weights(QuantType.Q4_1, *SHAPE)
    packed = pack(raw, QuantType.Q4_1)
    qtype, parts = packed.kernel_args
    with torch.inference_mode():
        x = torch.randn(24, SHAPE[1])
        out = torch.empty(24, SHAPE[0] + 4)[:, 4:]
        kernels.quant_matmul(x, qtype, parts, *SHAPE, out, 2, 0, 0)  # tiles, x rounded
    check(out, seen_x(kernels, QuantType.Q4_1, x), w)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_row_slices_are_weights_of_their_own(kernels, qtype):
    n, k = SHAPE
    raw, w = weights(qtype, n, k)
    packed = pack(raw, qtype)
    x = torch.randn(3, k)
    xs = seen_x(kernels, qtype, x)
    check(quant.matmul(x, packed.rows(100, 300)), xs, w[100:300])
    check(quant.matmul(x, packed.rows(572, n)), xs, w[572:])  # the padded last group
    with pytest.raises(ValueError, match="split a group"):
        packed.rows(2, 8)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_portable_build_matches(qtype):
    portable = quant.load("portable")
    assert portable is not None and portable.isa() == "portable"
    n, k = SHAPE
    raw, w = weights(qtype, n, k)
    packed = pack(raw, qtype)
    for t, mode in ((1, 1), (5, 1), (9, 1), (12, 2)):
        x = torch.randn(t, k)
        out = torch.empty(t, n)
        portable.quant_matmul(x, int(qtype), list(packed.parts), n, k, out, mode, 0, FLOAT)
        check(out, x, w)
        if qtype in INT8_TYPES and mode == 1:
            portable.quant_matmul(x, int(qtype), list(packed.parts), n, k, out, mode, 0, INT8)
            check(out, rounded_x(x), w)
    ids = torch.tensor([3, 0, n - 1])
    rows = torch.empty(3, k)
    portable.quant_embedding(ids, int(qtype), list(packed.parts), n, k, rows)
    assert torch.equal(rows, w[ids])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_embedding_is_exact(kernels, qtype):
    n, k = SHAPE
    raw, w = weights(qtype, n, k)
    packed = pack(raw, qtype)
    ids = torch.tensor([5, 0, n - 1, 5, 321])
    assert torch.equal(quant.embedding(ids, packed), w[ids])
    assert torch.equal(quant.embedding(ids, packed, torch.bfloat16), w[ids].bfloat16())
    assert torch.equal(quant.embedding(ids.reshape(1, 5), packed), w[ids].reshape(1, 5, k))
    assert quant.nbytes(packed) == packed.nbytes
    with pytest.raises(IndexError):
        quant.embedding(torch.tensor([n]), packed)


@pytest.mark.parametrize("qtype", [QuantType.Q4_1, QuantType.Q6_K], ids=lambda q: q.name)
def test_fallback_without_kernels(monkeypatch, qtype):
    monkeypatch.setattr(quant, "load", lambda build="native": None)
    n, k = SHAPE
    raw, w = weights(qtype, n, k)
    packed = pack(raw, qtype)
    x = torch.randn(4, k).bfloat16()
    fused = torch.zeros(4, n + 8, dtype=torch.bfloat16)
    check(quant.matmul(x, packed, out=fused[:, 8:]), x.float(), w)
    ids = torch.tensor([1, n - 1])
    assert torch.equal(quant.embedding(ids, packed), w[ids])
    with pytest.raises(IndexError):
        quant.embedding(torch.tensor([-1]), packed)


def test_bad_shapes_are_errors(kernels):
    raw, _ = weights(QuantType.Q8_0, 577, 768)
    packed = pack(raw, QuantType.Q8_0)
    with pytest.raises(RuntimeError, match="out must be"):
        quant.matmul(torch.randn(2, 768), packed, out=torch.empty(2, 576))
    with pytest.raises(RuntimeError, match="x must be"):
        quant.matmul(torch.randn(2, 512), packed)
    with pytest.raises(ValueError):
        pack(raw[:, :-1], QuantType.Q8_0)


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda q: q.name)
def test_int8_rows_are_the_same_bits_at_any_row_count(built, qtype):
    """Batch invariance (quant/__init__.py): a row's product does not depend on how many
    rows share the call, across passes of 1-8 rows and chunks of 64."""
    n, k = SHAPE
    raw, _ = weights(qtype, n, k)
    qt, parts = pack(raw, qtype).kernel_args
    x = torch.randn(150, k)

    def product(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], n)
        built.quant_matmul(rows, qt, parts, n, k, out, 0, 0, INT8)
        return out

    together = product(x)
    slices = ((0, 1), (3, 5), (7, 10), (20, 24), (30, 35), (40, 46), (80, 87), (61, 70), (0, 130))
    for start, stop in slices:
        assert torch.equal(product(x[start:stop]), together[start:stop]), (start, stop)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("activations", [FLOAT, 0], ids=["float", "auto"])
def test_grouped_experts_are_each_experts_own_product(built, qtype, activations):
    """Experts stacked in one weight, rows grouped by expert (some experts get none, one
    more than the float GEMV's rows, so it takes the tiles): one call gives each row
    what quant_matmul gives it against its expert, to the bit."""
    experts, m, k = 6, 64, 768
    raw, _ = weights(qtype, experts * m, k)
    packed = pack(raw, qtype)
    qt, parts = packed.kernel_args
    counts = [3, 0, 1, 20, 0, 7]
    starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
    x = torch.randn(starts[-1], k)
    got = torch.full((starts[-1], m), float("nan"))
    built.quant_grouped_matmul(x, qt, parts, experts * m, k, starts, got, activations)
    for e in range(experts):
        if counts[e]:
            expert_qt, expert_parts = packed.rows(e * m, (e + 1) * m).kernel_args
            want = torch.empty(counts[e], m)
            rows = x[starts[e] : starts[e + 1]]
            built.quant_matmul(rows, expert_qt, expert_parts, m, k, want, 0, 0, activations)
            assert torch.equal(got[starts[e] : starts[e + 1]], want), e
    with pytest.raises(RuntimeError, match="starts"):
        built.quant_grouped_matmul(x, qt, parts, experts * m, k, [0, 5], got, activations)
    with pytest.raises(RuntimeError, match="experts of whole row groups"):
        built.quant_grouped_matmul(x, qt, parts, experts * m, k, [0] * 5 + [31], got, activations)


@pytest.mark.parametrize("qtype", [QuantType.Q4_K, QuantType.Q6_K], ids=lambda q: q.name)
def test_grouped_experts_fallback_without_kernels(monkeypatch, qtype):
    experts, m, k = 3, 8, 256
    raw, w = weights(qtype, experts * m, k)
    packed = pack(raw, qtype)
    monkeypatch.setattr(quant, "load", lambda build="native": None)
    x = torch.randn(5, k)
    out = quant.grouped_matmul(x, packed, [0, 2, 2, 5])
    check(out[:2], x[:2], w[:m])
    check(out[2:], x[2:], w[2 * m :])
