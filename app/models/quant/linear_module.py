"""Layers over weights kept quantized: QuantLinear (one or more row segments, each its
own GGML type, side by side in one output, as our fused q|k|v and gate|up are) and
QuantEmbedding (rows dequantized on lookup; the LM head may share its weight).

The packed weights are plain attributes, not buffers: `Module.to(dtype)` must never
convert their fp16 scales.
"""

import torch
import torch.nn.functional as F
from torch import nn

from app.models.quantized_tensor import QuantizedTensor

Segment = object  # a packed quantized weight (app.models.quant.pack) or a float tensor


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, segment_rows: list[int], bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.segment_rows = list(segment_rows)
        self.out_features = sum(segment_rows)
        self.segments: list[Segment | None] = [None] * len(segment_rows)
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self.tied_to: QuantEmbedding | None = None

    @classmethod
    def tied(cls, embedding: "QuantEmbedding") -> "QuantLinear":
        """An LM head reading the (quantized) token embedding's rows."""
        head = cls(embedding.embedding_dim, [embedding.num_embeddings])
        head.tied_to = embedding
        return head

    def set_segment(self, index: int, weight: QuantizedTensor | torch.Tensor) -> None:
        from app.models import quant

        rows, cols = tuple(weight.shape)
        if (rows, cols) != (self.segment_rows[index], self.in_features):
            raise ValueError(
                f"weight of shape {(rows, cols)}, expected "
                f"{(self.segment_rows[index], self.in_features)}"
            )
        if isinstance(weight, QuantizedTensor):
            self.segments[index] = quant.pack(weight.data, weight.qtype, weight.cols)
        else:
            self.segments[index] = weight.detach().clone()

    @property
    def ready(self) -> bool:
        return self.tied_to is not None or all(s is not None for s in self.segments)

    def nbytes(self) -> int:
        from app.models import quant

        return sum(quant.nbytes(s) for s in self.segments if s is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from app.models import quant

        segments = [self.tied_to.weight] if self.tied_to is not None else self.segments
        out = x.new_empty((x.shape[0], self.out_features))
        start = 0
        for segment, rows in zip(segments, self.segment_rows, strict=True):
            part = out[:, start : start + rows]
            if isinstance(segment, torch.Tensor):
                part.copy_(F.linear(x, segment.to(x.dtype)))
            else:
                quant.matmul(x, segment, out=part)
            start += rows
        if self.bias is not None:
            out += self.bias
        return out


class QuantEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight: Segment | None = None
        self.out_dtype = torch.float32  # set to the model's dtype by the loader

    def set_segment(self, index: int, weight: QuantizedTensor | torch.Tensor) -> None:
        from app.models import quant

        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)}, expected "
                f"{(self.num_embeddings, self.embedding_dim)}"
            )
        if isinstance(weight, QuantizedTensor):
            self.weight = quant.pack(weight.data, weight.qtype, weight.cols)
        else:
            self.weight = weight.detach().clone()

    @property
    def ready(self) -> bool:
        return self.weight is not None

    def nbytes(self) -> int:
        from app.models import quant

        return quant.nbytes(self.weight) if self.weight is not None else 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from app.models import quant

        if isinstance(self.weight, torch.Tensor):
            return F.embedding(ids, self.weight).to(self.out_dtype)
        return quant.embedding(ids, self.weight, self.out_dtype)
