"""The GGML block formats Shoal runs on directly, and their exact dequantisation.

A quantised row of K weights is K / block_elems blocks of block_bytes each, laid out
as llama.cpp writes them (ggml-common.h):

    Q4_0   32 weights, 18 bytes: d fp16, 16 bytes of nibbles; w = d * (q - 8)
    Q4_1   32 weights, 20 bytes: d fp16, m fp16, 16 bytes of nibbles; w = d * q + m
    Q8_0   32 weights, 34 bytes: d fp16, 32 int8; w = d * q
    Q4_K  256 weights, 144 bytes: d fp16, dmin fp16, 12 bytes of eight 6-bit scales and
          eight 6-bit mins, 128 bytes of nibbles; w = (d * sc) * q - dmin * m per 32
    Q5_K  256 weights, 176 bytes: Q4_K's d, dmin and scales, 32 bytes of fifth bits (bit s
          of byte j: weight 32 s + j), 128 bytes of nibbles as Q4_K's; q = nibble + 16 * bit
    Q6_K  256 weights, 210 bytes: 128 bytes low nibbles, 64 bytes high 2-bit pairs,
          16 int8 scales, d fp16 (last); w = (d * sc) * (q - 32) per 16

In Q4_0/Q4_1 a block's byte j holds weight j (low nibble) and weight j + 16 (high).
The reference is gguf's own numpy dequantiser, so "exact" means what llama.cpp's
converter computes, bit for bit.
"""

from enum import IntEnum

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize


class QuantType(IntEnum):
    """GGML type ids (the numbers a GGUF file stores per tensor)."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14

    @property
    def block_elems(self) -> int:
        return GGML_QUANT_SIZES[GGMLQuantizationType(self.value)][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[GGMLQuantizationType(self.value)][1]

    def row_bytes(self, k: int) -> int:
        if k % self.block_elems:
            raise ValueError(f"{self.name} rows hold multiples of {self.block_elems}, not {k}")
        return k // self.block_elems * self.block_bytes


def dequantize(raw: torch.Tensor, qtype: QuantType, k: int) -> torch.Tensor:
    """(N, row_bytes) uint8 as stored in the file -> (N, K) float32, exactly as gguf computes."""
    qtype = QuantType(qtype)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != qtype.row_bytes(k):
        raise ValueError(
            f"expected (N, {qtype.row_bytes(k)}) uint8 for {qtype.name} rows of {k}, "
            f"got {tuple(raw.shape)} {raw.dtype}"
        )
    values = _gguf_dequantize(raw.contiguous().numpy(), GGMLQuantizationType(qtype.value))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(-1, k)
