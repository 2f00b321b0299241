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
        self._runs: list[tuple[Segment, int, int]] | None = None  # see _plan

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
        self._runs = self._plan() if self.ready else None

    @property
    def ready(self) -> bool:
        return self.tied_to is not None or all(s is not None for s in self.segments)

    def _plan(self) -> list[tuple[Segment, int, int]]:
        """(weight, first output column, last + 1): adjacent segments of one GGML type
        merged into one weight, so q|k|v or gate|up of one type is one kernel call (a
        decode step of a small model pays ~5 us per call). The merged segments become
        views of the merged weight, so the memory is held once."""
        from app.models.quant.packed_weight import GROUP, PackedWeight, concat

        if self.tied_to is not None:
            return [(self.tied_to.weight, 0, self.out_features)]
        groups: list[list[int]] = []  # indices of segments merged together
        for i, segment in enumerate(self.segments):
            prev = self.segments[groups[-1][-1]] if groups else None
            if (
                isinstance(segment, PackedWeight)
                and isinstance(prev, PackedWeight)
                and (prev.qtype, prev.k) == (segment.qtype, segment.k)
                and prev.n % GROUP == 0
            ):
                groups[-1].append(i)
            else:
                groups.append([i])
        starts = [sum(self.segment_rows[:i]) for i in range(len(self.segments) + 1)]
        runs: list[tuple[Segment, int, int]] = []
        for group in groups:
            first, last = group[0], group[-1]
            weight = self.segments[first]
            if len(group) > 1:
                weight = concat([self.segments[i] for i in group])
                for i in group:
                    self.segments[i] = weight.rows(
                        starts[i] - starts[first], starts[i + 1] - starts[first]
                    )
            runs.append((weight, starts[first], starts[last + 1]))
        return runs

    def runs(self) -> list[tuple[Segment, int, int]]:
        """(weight, first output column, last + 1) per kernel call of a forward."""
        if self._runs is None:  # the tied head: its embedding loads after it
            self._runs = self._plan()
        return self._runs

    def nbytes(self) -> int:
        from app.models import quant

        return sum(quant.nbytes(s) for s in self.segments if s is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from app.models import quant

        runs = self.runs()
        if len(runs) == 1 and not isinstance(runs[0][0], torch.Tensor):
            out = quant.matmul(x, runs[0][0])
        else:
            out = x.new_empty((x.shape[0], self.out_features))
            for weight, start, stop in runs:
                part = out[:, start:stop]
                if isinstance(weight, torch.Tensor):
                    part.copy_(F.linear(x, weight.to(x.dtype)))
                else:
                    quant.matmul(x, weight, out=part)
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
