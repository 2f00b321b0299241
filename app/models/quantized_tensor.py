"""QuantizedTensor: a GGUF weight kept as the file stores it (GGML blocks per row), so
the loader can hand it to quantized layers instead of dequantizing it.

Rows of GGML formats are independent runs of blocks, so everything the loader does to
a weight's rows (llama.cpp's q/k permutation undone, Phi-3's fused projections split,
a tensor-parallel slice of rows) works on the raw bytes as it does on floats.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedTensor:
    data: torch.Tensor  # uint8 (rows, bytes per row)
    qtype: int  # the GGML type id
    cols: int  # elements per row

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.cols)

    def rows(self, start: int, count: int) -> "QuantizedTensor":
        return QuantizedTensor(self.data.narrow(0, start, count), self.qtype, self.cols)

    def split(self, sizes: list[int] | int, dim: int = 0) -> list["QuantizedTensor"]:
        if dim != 0:
            raise ValueError("a quantized weight splits by rows only")
        return [QuantizedTensor(part, self.qtype, self.cols) for part in self.data.split(sizes)]

    def with_rows(self, data: torch.Tensor) -> "QuantizedTensor":
        """The same weight with its rows rearranged (`data`: the rearranged bytes)."""
        return QuantizedTensor(data, self.qtype, self.cols)

    def dequantize(self) -> torch.Tensor:
        from app.models.quant import dequantize

        return dequantize(self.data, self.qtype, self.cols)
