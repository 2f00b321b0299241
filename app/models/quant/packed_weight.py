"""PackedWeight: one quantised (N, K) matrix in the layout the kernels read.

Rows go in groups of GROUP = 4, interleaved unit by unit (per 32-weight block the four
rows' quants side by side, likewise their scales), so the GEMV streams one sequential
array instead of four short runs (formats.h says why). Every part is (ceil(N / 4),
4 * columns); the last group is padded with zero rows. A slice of whole groups (a
tensor-parallel shard) is a PackedWeight of its own without copying.
"""

import functools
from dataclasses import dataclass

import torch

from app.models.quant.formats import QuantType

GROUP = 4  # rows per interleaved group (kG in formats.h)

# The parts of each type, in the order the C++ kernels take them (per row of K weights,
# before interleaving):
#   qs/lo  weights in "nibble order": per 32 weights 16 bytes, byte j = w[j] | w[j+16] << 4
#   hi     Q6_K high bit pairs: per 32 weights 8 bytes, byte j bits 2i..2i+1 = w[j + 8i] >> 4
#   qh     Q5_K fifth bits: per 32 weights two 16-bit units, bit j of unit 0 = w[j] >> 4, of
#          unit 1 = w[16 + j] >> 4 (interleaved, a group's four rows' unit 0 make 64 bits)
#   d, m, dmin fp16 scales (per 32 weights, or per 256 in the K types)
#   sc, mn Q4_K's and Q5_K's 6-bit scales and mins unpacked to one byte per 32; Q6_K's int8 per 16
PART_NAMES: dict[QuantType, tuple[str, ...]] = {
    QuantType.Q4_0: ("qs", "d"),
    QuantType.Q4_1: ("qs", "d", "m"),
    QuantType.Q8_0: ("qs", "d"),
    QuantType.Q4_K: ("qs", "d", "dmin", "sc", "mn"),
    QuantType.Q5_K: ("qs", "qh", "d", "dmin", "sc", "mn"),
    QuantType.Q6_K: ("lo", "hi", "sc", "d"),
}


@dataclass(frozen=True, eq=False)
class PackedWeight:
    qtype: QuantType
    n: int  # rows (output features)
    k: int  # columns (input features)
    parts: tuple[torch.Tensor, ...]

    def part(self, name: str) -> torch.Tensor:
        return self.parts[PART_NAMES[self.qtype].index(name)]

    @functools.cached_property
    def kernel_args(self) -> tuple[int, list[torch.Tensor]]:
        """(GGML type id, parts) as the C++ kernels take them, converted once."""
        return int(self.qtype), list(self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts)

    def rows(self, start: int, stop: int) -> "PackedWeight":
        """Rows [start, stop) as views of the same storage: start a multiple of GROUP, and
        stop too unless it is the last row."""
        if not 0 <= start <= stop <= self.n:
            raise ValueError(f"rows [{start}, {stop}) outside 0..{self.n}")
        if start % GROUP or (stop % GROUP and stop != self.n):
            raise ValueError(f"rows [{start}, {stop}) split a group of {GROUP}")
        g0, g1 = start // GROUP, -(-stop // GROUP)
        return PackedWeight(self.qtype, stop - start, self.k, tuple(p[g0:g1] for p in self.parts))


def concat(weights: list[PackedWeight]) -> PackedWeight:
    """Rows of several weights of one type and width, one after another, as one weight:
    fused projections (q|k|v, gate|up) then cost one kernel call. All but the last must
    hold whole groups, or padding rows would land between them."""
    first = weights[0]
    for w in weights:
        if (w.qtype, w.k) != (first.qtype, first.k):
            raise ValueError("only weights of one type and width concatenate")
    if any(w.n % GROUP for w in weights[:-1]):
        raise ValueError(f"every weight but the last must hold a multiple of {GROUP} rows")
    parts = tuple(torch.cat(ps) for ps in zip(*(w.parts for w in weights), strict=True))
    return PackedWeight(first.qtype, sum(w.n for w in weights), first.k, parts)
