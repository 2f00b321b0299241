"""pack/unpack between GGUF rows and the kernels' layout (PackedWeight), losslessly.

Repacking separates scales from quants so the kernels load 16 or 32 weight bytes at a
time, gives every 4-bit type the same nibble order (Q4_0/Q4_1's own), so one decoder
serves Q4_0, Q4_1 and Q4_K, and interleaves rows in groups of four (packed_weight.py).
Sizes match the file's except Q4_K and Q5_K, whose 6-bit scales and mins take a byte
each: 148 bytes per 256 weights instead of 144 (+2.8 %), 180 instead of 176 (+2.3 %);
and up to three zero rows of padding.
"""

import torch

from app.models.quant.formats import QuantType, dequantize
from app.models.quant.packed_weight import GROUP, PackedWeight


def _halves(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 -> (...) float16, the bytes reinterpreted (little endian)."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _bytes(h: torch.Tensor) -> torch.Tensor:
    """(...) float16 -> (..., 2) uint8."""
    return h.contiguous().unsqueeze(-1).view(torch.uint8)


def _interleave(t: torch.Tensor, unit: int) -> torch.Tensor:
    """(N, C) -> (ceil(N / GROUP), GROUP * C): per group, unit u of every row, then u + 1."""
    n, c = t.shape
    t = torch.cat([t, t.new_zeros((-n % GROUP, c))])  # (N', C)
    return t.reshape(-1, GROUP, c // unit, unit).transpose(1, 2).reshape(-1, GROUP * c).contiguous()


def _deinterleave(t: torch.Tensor, unit: int, n: int) -> torch.Tensor:
    """The inverse of _interleave: (groups, GROUP * C) -> (n, C)."""
    c = t.shape[1] // GROUP
    return t.reshape(-1, c // unit, GROUP, unit).transpose(1, 2).reshape(-1, c)[:n]


def _to_nibbles(v: torch.Tensor) -> torch.Tensor:
    """(..., 32) values < 16 -> (..., 16) bytes, byte j = v[j] | v[j + 16] << 4."""
    return v[..., :16] | (v[..., 16:] << 4)


def _from_nibbles(b: torch.Tensor) -> torch.Tensor:
    return torch.cat([b & 15, b >> 4], dim=-1)


def pack(raw: torch.Tensor, qtype: QuantType, k: int | None = None) -> PackedWeight:
    """(N, row_bytes) uint8 as stored in the GGUF -> PackedWeight (K inferred from the width)."""
    qtype = QuantType(qtype)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % qtype.block_bytes:
        raise ValueError(
            f"expected (N, blocks * {qtype.block_bytes}) uint8, got {tuple(raw.shape)}"
        )
    n, nb = raw.shape[0], raw.shape[1] // qtype.block_bytes
    k_inferred = nb * qtype.block_elems
    if k is not None and k != k_inferred:
        raise ValueError(
            f"rows of {raw.shape[1]} bytes hold {k_inferred} {qtype.name} weights, not {k}"
        )
    blocks = raw.reshape(n, nb, qtype.block_bytes)
    rows = _PACK[qtype](blocks, n)  # each (N, C), row by row
    parts = tuple(_interleave(p, u) for p, u in zip(rows, UNITS[qtype], strict=True))
    return PackedWeight(qtype, n, k_inferred, parts)


def unpack(packed: PackedWeight) -> torch.Tensor:
    """The inverse of pack: the GGUF's bytes, (N, row_bytes) uint8."""
    units = UNITS[packed.qtype]
    rows = tuple(_deinterleave(p, u, packed.n) for p, u in zip(packed.parts, units, strict=True))
    blocks = _UNPACK[packed.qtype](rows, packed.n)
    return blocks.reshape(packed.n, -1).contiguous()


def dequantize_packed(packed: PackedWeight) -> torch.Tensor:
    """(N, K) float32, exactly what dequantize gives for the GGUF rows."""
    return dequantize(unpack(packed), packed.qtype, packed.k)


def _pack_q4_0(b, n):  # (N, KB, 18): d, 16 nibble bytes
    return (b[..., 2:].reshape(n, -1).contiguous(), _halves(b[..., :2]))


def _unpack_q4_0(parts, n):
    qs, d = parts
    return torch.cat([_bytes(d), qs.reshape(n, -1, 16)], dim=-1)


def _pack_q4_1(b, n):  # (N, KB, 20): d, m, 16 nibble bytes
    return (b[..., 4:].reshape(n, -1).contiguous(), _halves(b[..., :2]), _halves(b[..., 2:4]))


def _unpack_q4_1(parts, n):
    qs, d, m = parts
    return torch.cat([_bytes(d), _bytes(m), qs.reshape(n, -1, 16)], dim=-1)


def _pack_q8_0(b, n):  # (N, KB, 34): d, 32 int8
    return (b[..., 2:].reshape(n, -1).contiguous().view(torch.int8), _halves(b[..., :2]))


def _unpack_q8_0(parts, n):
    qs, d = parts
    return torch.cat([_bytes(d), qs.view(torch.uint8).reshape(n, -1, 32)], dim=-1)


def _k_scales(b, n):  # Q4_K's and Q5_K's head: d, dmin, 12 bytes of 6-bit scales and mins
    s = b[..., 4:16].reshape(n, -1, 3, 4)
    lo, mid, top = s[..., 0, :], s[..., 1, :], s[..., 2, :]  # see gguf's Q4_K.get_scale_min
    sc = torch.cat([lo & 63, (top & 15) | ((lo >> 2) & 48)], dim=-1)  # (N, NS, 8)
    mn = torch.cat([mid & 63, (top >> 4) | ((mid >> 2) & 48)], dim=-1)
    return (
        _halves(b[..., 0:2]),
        _halves(b[..., 2:4]),
        sc.reshape(n, -1).contiguous(),
        mn.reshape(n, -1).contiguous(),
    )


def _k_head(d, dmin, sc, mn, n):
    sc, mn = sc.reshape(n, -1, 8), mn.reshape(n, -1, 8)
    lo = sc[..., :4] | ((sc[..., 4:] & 48) << 2)
    mid = mn[..., :4] | ((mn[..., 4:] & 48) << 2)
    top = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return [_bytes(d), _bytes(dmin), lo, mid, top]


def _k_nibbles(q, n):
    """(N, NS, 128) bytes, 64 weights per 32 (low nibbles sub-block 2j, high 2j + 1) ->
    (N, K/32, 32) values."""
    q = q.reshape(n, -1, 4, 1, 32)
    return torch.cat([q & 15, q >> 4], dim=-2).reshape(n, -1, 32)


def _k_bytes(values, n):
    """The inverse of _k_nibbles."""
    values = values.reshape(n, -1, 4, 2, 32)
    return (values[..., 0, :] | (values[..., 1, :] << 4)).reshape(n, -1, 128)


def _pack_q4_k(b, n):  # (N, NS, 144): d, dmin, 12 scale bytes, 128 nibble bytes
    values = _k_nibbles(b[..., 16:], n)
    return (_to_nibbles(values).reshape(n, -1), *_k_scales(b, n))


def _unpack_q4_k(parts, n):
    qs, d, dmin, sc, mn = parts
    values = _from_nibbles(qs.reshape(n, -1, 16))
    return torch.cat([*_k_head(d, dmin, sc, mn, n), _k_bytes(values, n)], dim=-1)


def _pack_q5_k(b, n):  # (N, NS, 176): d, dmin, 12 scale bytes, 32 fifth-bit bytes, 128 nibbles
    qh = b[..., 16:48].reshape(n, -1, 1, 32)
    shifts = torch.arange(8, dtype=torch.uint8).view(8, 1)
    fifth = ((qh >> shifts) & 1).reshape(n, -1, 4, 8)  # weight 32 s + j, 8 at a time
    # per 32 weights 4 bytes, bit j of byte i = w[8 i + j] >> 4: two little-endian units.
    # uint8 throughout: a wider dtype took ~17 bytes per weight while loading.
    bits = fifth[..., 0].clone()
    for j in range(1, 8):
        bits |= fifth[..., j] << j
    values = _k_nibbles(b[..., 48:], n)
    return (_to_nibbles(values).reshape(n, -1), bits.reshape(n, -1), *_k_scales(b, n))


def _unpack_q5_k(parts, n):
    qs, qh, d, dmin, sc, mn = parts
    shifts = torch.arange(8, dtype=torch.uint8)
    fifth = ((qh.reshape(n, -1, 4, 1) >> shifts) & 1).reshape(n, -1, 8, 32)  # (N, NS, s, j)
    packed = fifth[..., 0, :].clone()
    for s in range(1, 8):
        packed |= fifth[..., s, :] << s
    values = _from_nibbles(qs.reshape(n, -1, 16))
    head = _k_head(d, dmin, sc, mn, n)
    return torch.cat([*head, packed, _k_bytes(values, n)], dim=-1)


def _pack_q6_k(b, n):  # (N, NS, 210): 128 low-nibble bytes, 64 high-pair bytes, 16 sc, d
    ql = b[..., :128].reshape(n, -1, 2, 64)
    qh = b[..., 128:192].reshape(n, -1, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=-1)  # (N, NS, 2, 128)
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2).reshape(n, -1, 2, 128)
    values = (low | (high << 4)).reshape(n, -1, 32)  # (N, K/32, 32), 0..63
    pairs = (values >> 4).reshape(n, -1, 4, 8)  # [i, j] = weight j + 8i
    hi = (
        pairs[..., 0, :]
        | (pairs[..., 1, :] << 2)
        | (pairs[..., 2, :] << 4)
        | (pairs[..., 3, :] << 6)
    )
    return (
        _to_nibbles(values & 15).reshape(n, -1),
        hi.reshape(n, -1).contiguous(),
        b[..., 192:208].reshape(n, -1).contiguous().view(torch.int8),
        _halves(b[..., 208:210]),
    )


def _unpack_q6_k(parts, n):
    lo, hi, sc, d = parts
    low = _from_nibbles(lo.reshape(n, -1, 16))  # (N, K/32, 32)
    h = hi.reshape(n, -1, 1, 8)
    pairs = torch.cat([(h >> s) & 3 for s in (0, 2, 4, 6)], dim=-2).reshape(n, -1, 32)
    values = (low | (pairs << 4)).reshape(n, -1, 2, 128)
    ql = (values[..., :64] & 15) | ((values[..., 64:] & 15) << 4)  # (N, NS, 2, 64)
    hv = (values >> 4).reshape(n, -1, 2, 4, 32)
    qh = hv[..., 0, :] | (hv[..., 1, :] << 2) | (hv[..., 2, :] << 4) | (hv[..., 3, :] << 6)
    return torch.cat(
        [
            ql.reshape(n, -1, 128),
            qh.reshape(n, -1, 64),
            sc.view(torch.uint8).reshape(n, -1, 16),
            _bytes(d),
        ],
        dim=-1,
    )


# Interleaving unit of each part, in elements: a block's (or sub-block's) share of a row.
UNITS = {
    QuantType.Q4_0: (16, 1),
    QuantType.Q4_1: (16, 1, 1),
    QuantType.Q8_0: (32, 1),
    QuantType.Q4_K: (16, 1, 1, 1, 1),
    QuantType.Q5_K: (16, 2, 1, 1, 1, 1),
    QuantType.Q6_K: (16, 8, 1, 1),
}

_PACK = {
    QuantType.Q4_0: _pack_q4_0,
    QuantType.Q4_1: _pack_q4_1,
    QuantType.Q8_0: _pack_q8_0,
    QuantType.Q4_K: _pack_q4_k,
    QuantType.Q5_K: _pack_q5_k,
    QuantType.Q6_K: _pack_q6_k,
}
_UNPACK = {
    QuantType.Q4_0: _unpack_q4_0,
    QuantType.Q4_1: _unpack_q4_1,
    QuantType.Q8_0: _unpack_q8_0,
    QuantType.Q4_K: _unpack_q4_k,
    QuantType.Q5_K: _unpack_q5_k,
    QuantType.Q6_K: _unpack_q6_k,
}
