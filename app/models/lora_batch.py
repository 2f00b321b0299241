"""A step's LoRA adapters and their rows, applied beside the base projections.

Two ways, one result, to the bit, whatever the rows' count (MIN_ROWS; on a CPU: on a GPU
cuBLAS may choose other kernels for other shapes). Where a step's rows are spread evenly
over adapters of one shape (the same rank and targets: fine-tunes of one recipe), it
runs Punica's and S-LoRA's batched shrink and expand: those adapters stacked, each one's
rows a block of its own (padded to the longest), one batched matmul for all of them per
shrink and per part's expansion, added in place to the rows' block (views of the step's
rows where they are the stacked adapters' alone, in order; else gathered, and the real
rows copied back). The stack is built when the step's set of adapters changes and kept
while it does not (a stream's adapters stay the same step after step). Every other
adapter's run of consecutive rows (the input batch puts a step's sequences of one
adapter next to each other), and a step whose rows are uneven (one long prompt beside a
few decodes would pad every block to its length), runs on its own.
"""

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.models.lora import LoraAdapter

PROJECTIONS = ("qkv", "o", "gate_up", "down")
# Every product runs over at least this many rows (zero rows padding a shorter run or
# block): BLAS takes other kernels, with other sums, for a few rows (on this CPU's MKL
# for 1-3, 5-7 and 9-11 of them), and after the int8-quantized activations of a
# quantized base (app/models/quant) one ulp can flip a quantization step. Padded, a
# row's result does not depend on how many rows share its step: a prompt's last rows
# after a cached prefix, or a decode beside others, get what they get alone.
MIN_ROWS = 16  # on a CPU (on a GPU, cuBLAS makes no such promise to pad for)


@dataclass(frozen=True)
class StackedLoras:
    """Adapters of one signature stacked: per layer and projection, A (n, in, r) and each
    part's (column, r0, r1, B (n, r_part, width)); their order `uids`'."""

    uids: tuple[int, ...]
    layers: tuple[dict[str, tuple[torch.Tensor, tuple]], ...]

    @classmethod
    def of(cls, adapters: Seq[LoraAdapter]) -> "StackedLoras":
        layers = []
        for index, first in enumerate(adapters[0].layers):
            layer = {}
            for proj, (_, parts) in first.items():
                fused = [a.layers[index][proj] for a in adapters]
                stacked = [
                    (c, r0, r1, torch.stack([f[1][k][3] for f in fused]))
                    for k, (c, r0, r1, _) in enumerate(parts)
                ]
                layer[proj] = (torch.stack([f[0] for f in fused]), tuple(stacked))
            layers.append(layer)
        return cls(tuple(a.uid for a in adapters), tuple(layers))


@dataclass(frozen=True)
class LoraBatch:
    """A step's adapters: `runs` of consecutive flat-batch rows, each with its adapter
    (the input batch puts a step's sequences of one adapter next to each other), and,
    for the batched way, the stack and each block's rows (`gather`, n x m of them, m the
    most rows any adapter has; padding points past the batch, at a zero row)."""

    runs: tuple[tuple[LoraAdapter, int, int], ...]  # (adapter, first row, one past last)
    # the stacked adapters' rows are not in `runs`
    stacked: StackedLoras | None = None
    # (n * m,) rows of x, its row count for padding; None: all rows, in order
    gather: torch.Tensor | None = None
    # (places in `gather` that are not padding, their rows): only those are written back,
    # each rounded once, as its adapter alone rounds it
    real: tuple[torch.Tensor, torch.Tensor] | None = None

    def to(self, device: torch.device) -> "LoraBatch":
        if self.gather is None or self.gather.device == device:
            return self
        assert self.real is not None
        real = (self.real[0].to(device), self.real[1].to(device))
        return LoraBatch(self.runs, self.stacked, self.gather.to(device), real)

    def add_(self, base: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """base += each adapter applied to x, on its rows, in place (`base` is one of the
        step's own activations), and returned."""
        if self.stacked is not None and (fused := self.stacked.layers[layer].get(proj)):
            a, parts = fused
            shrunk = torch.bmm(self._blocks(x, a.shape[0]), a)
            if self.gather is None:  # each part expands into its columns of the rows' block
                blocks = base.view(a.shape[0], -1, base.shape[1])
                for column, r0, r1, b in parts:
                    blocks[:, :, column : column + b.shape[2]].baddbmm_(shrunk[:, :, r0:r1], b)
            else:  # the same on gathered rows of base, its real ones written back
                for column, r0, r1, b in parts:
                    cols = base[:, column : column + b.shape[2]]
                    block = self._blocks(cols, a.shape[0])
                    block.baddbmm_(shrunk[:, :, r0:r1], b)
                    flat = block.view(-1, b.shape[2]).index_select(0, self.real[0])
                    cols.index_copy_(0, self.real[1], flat)
        for adapter, start, end in self.runs:
            fused = adapter.layers[layer].get(proj)
            if fused is None:
                continue
            a, parts = fused
            pad = max(0, MIN_ROWS - (end - start)) if x.is_cpu else 0
            shrunk = (F.pad(x[start:end], (0, 0, 0, pad)) if pad else x[start:end]) @ a
            rows = base[start:end]
            for column, r0, r1, b in parts:  # each part's expansion into its own columns
                cols = rows[:, column : column + b.shape[1]]
                if not pad:
                    cols.addmm_(shrunk[:, r0:r1], b)
                else:  # on a padded copy, the real rows written back
                    cols.copy_(F.pad(cols, (0, 0, 0, pad)).addmm_(shrunk[:, r0:r1], b)[:-pad])
        return base

    def _blocks(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """The stacked adapters' rows of x, a block (of m rows) each."""
        if self.gather is None:  # the step is theirs, in order, as many rows each
            return x.view(n, -1, x.shape[1])
        # padding points past the batch, at a zero row (never written back)
        return F.pad(x, (0, 0, 0, 1)).index_select(0, self.gather).view(n, -1, x.shape[1])
