"""DecodeGraphs: all-decode steps through static buffers, replayed as CUDA graphs.

On a GPU, a decode step launches a few hundred small kernels, and in eager PyTorch the
host takes longer to launch them than the GPU to run them: 20-24 ms a step on an H100
for SmolLM2 and for an 8B model alike. A CUDA graph replays a captured step in one
launch, but only over the buffers and shapes it was captured with. So:
- a step's batch is rounded up to a bucket (1, 2, 4, 8, then every 16 up to
  max_num_seqs, at most 256); each bucket has its graph, captured at start-up largest
  first, all sharing one memory pool;
- a step copies its inputs into the first rows of static buffers; padding rows decode
  token 0 at position 0 into a scratch block that no sequence owns (the runner keeps one
  past the block manager's), and their logits are dropped;
- block tables have the model's full width, so no graph depends on a context's length:
  the attention kernels read a row only up to its length.
Without CUDA (tests, CPU) the same buffers, buckets and padding run eagerly, so the path
a graph replays is the one the CPU tests check. Steps with prefill tokens, or more
sequences than the largest bucket, run eagerly as before.
"""

import logging
import time
from typing import Any

import torch
from torch import nn

from app.engine.input_batch import StepInputs
from app.models.attention import AttentionBackend

logger = logging.getLogger(__name__)

MAX_BUCKET = 256


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ...: every batch up to min(max_num_seqs, 256) has a bucket."""
    top = min(max_num_seqs, MAX_BUCKET)
    sizes = [b for b in (1, 2, 4, 8) if b < top]
    sizes += range(16, top, 16)
    return [*sizes, -(-top // 16) * 16 if top > 8 else top]


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        max_num_seqs: int,
        max_blocks: int,
        scratch_block: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        """Raises NotImplementedError when `backend` cannot describe a decode step from
        device tensors (the torch backend's gathers on a GPU)."""
        self.model, self.backend, self.device = model, backend, device
        self.buckets = bucket_sizes(max_num_seqs)
        size = self.buckets[-1]
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size  # padding rows write here
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.full((size,), self.scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.full(
            (size, max_blocks), scratch_block, dtype=torch.int32, device=device
        )
        self.lens = torch.ones(size, dtype=torch.int32, device=device)
        self.rows = torch.arange(size, device=device)  # every row's logits
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (graph, logits)
        self.padded_rows = 0  # rows past this one hold padding already
        self.capture_s = 0.0  # how long capture() took
        backend.decode_metadata(self.slots[:1], self.tables[:1], self.lens[:1])

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds `num_seqs`; None past the largest."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def fits(self, step: StepInputs) -> bool:
        n = len(step.layout.query_lens)
        return step.is_all_decode and n <= self.buckets[-1]

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor:
        """The step's logits (S', vocab), rows in `step.logits_rows` order; a view into a
        static buffer, valid until the next run."""
        n = len(step.layout.query_lens)
        bucket = self.bucket_for(n)
        self._load(step, n, bucket)
        if bucket in self.graphs:
            graph, logits = self.graphs[bucket]
            graph.replay()
        else:
            logits = self._forward(bucket)
        if step.logits_rows.shape[0] == n:  # every sequence sampled: rows 0..n-1
            return logits[:n]
        return logits[step.logits_rows.to(self.device)]

    def capture(self) -> float:
        """Capture every bucket's graph (CUDA only); returns the seconds it took."""
        start = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for bucket in reversed(self.buckets):
                self._forward(bucket)  # compiles kernels, allocates workspaces: not in a graph
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(bucket)
                pool = graph.pool()
                self.graphs[bucket] = (graph, logits)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        logger.info("captured %d decode graphs in %.1f s", len(self.graphs), self.capture_s)
        return self.capture_s

    def _forward(self, bucket: int) -> torch.Tensor:
        b = slice(0, bucket)
        metadata = self.backend.decode_metadata(self.slots[b], self.tables[b], self.lens[b])
        return self.model(self.input_ids[b], self.positions[b], metadata, self.rows[b])

    def _load(self, step: StepInputs, n: int, bucket: int) -> None:
        """The step's inputs into rows 0..n-1; rows n..bucket-1 padding. Padding must
        never write a live block, so rows a larger step used are reset before they pad."""
        layout = step.layout
        nblk = layout.block_tables.shape[1]
        copy = self._copy
        copy(self.input_ids[:n], step.input_ids)
        copy(self.positions[:n], step.positions)
        copy(self.slots[:n], layout.slot_mapping)
        copy(self.tables[:n, :nblk], layout.block_tables)
        copy(self.lens[:n], torch.tensor(layout.context_lens, dtype=torch.int32))
        if self.padded_rows > n:
            stale = slice(n, self.padded_rows)
            self.input_ids[stale] = 0
            self.positions[stale] = 0
            self.slots[stale] = self.scratch_slot
            self.tables[stale, 0] = self.scratch_block
            self.lens[stale] = 1
        self.padded_rows = n

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.device.type == "cuda":
            src = src.pin_memory()
        dst.copy_(src, non_blocking=True)
