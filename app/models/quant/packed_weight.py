"""PackedWeight: one quantised (N, K) matrix in the layout the kernels read.

Every part is a contiguous tensor whose first dimension is the row, so a slice of rows
(a tensor-parallel shard, or one of the q/k/v segments of a fused projection) is a
PackedWeight of its own without copying.
"""

from dataclasses import dataclass

import torch

from app.models.quant.formats import QuantType

# The parts of each type, in the order the C++ kernels take them (shapes per row of K):
#   qs/lo  weights in "nibble order": per 32 weights 16 bytes, byte j = w[j] | w[j+16] << 4
#   hi     Q6_K high bit pairs: per 32 weights 8 bytes, byte j bits 2i..2i+1 = w[j + 8i] >> 4
#   d, m, dmin fp16 scales (per 32 weights, or per 256 in the K types)
#   sc, mn Q4_K's 6-bit scales and mins unpacked to one byte per 32; Q6_K's int8 per 16
PART_NAMES: dict[QuantType, tuple[str, ...]] = {
    QuantType.Q4_0: ("qs", "d"),
    QuantType.Q4_1: ("qs", "d", "m"),
    QuantType.Q8_0: ("qs", "d"),
    QuantType.Q4_K: ("qs", "d", "dmin", "sc", "mn"),
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

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts)

    def rows(self, start: int, stop: int) -> "PackedWeight":
        """Rows [start, stop) as views of the same storage."""
        if not 0 <= start <= stop <= self.n:
            raise ValueError(f"rows [{start}, {stop}) outside 0..{self.n}")
        return PackedWeight(
            self.qtype, stop - start, self.k, tuple(p[start:stop] for p in self.parts)
        )
