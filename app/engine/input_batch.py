"""InputBatch: a step's model inputs, kept between steps, one row per running sequence.

A decode step changes little: each sequence's context grows by a token and, once every
block_size tokens, its block table by a block. So block tables live in one preallocated
(rows, blocks) array in which a sequence keeps its row while it runs, and a step writes
only what changed: the blocks appended since the sequence last ran, or the whole row of
a sequence new to the batch or whose table was rewritten (copy-on-write). Positions and
cache slots are then computed for all tokens at once in numpy from the rows, never per
token in Python (vLLM's persistent batch does the same).

Invariants:
- `_rows` maps the seq_id of every sequence that ran since it last left the running set
  to its row; the scheduler reports departures (ScheduledBatch.left), which free rows;
- `_tables[row, :_synced[row]]` equals that sequence's block table, unless the
  sequence is in the step's `tables_changed` (then the row is written again).
"""

from dataclasses import dataclass, replace

import numpy as np
import torch

from app.engine.adapters import StepAdapters, adapter_order
from app.engine.images import both_ways_spans, sees_both_ways, step_rows
from app.engine.mrope import step_positions
from app.engine.scheduler import ScheduledBatch
from app.engine.sequence import Sequence
from app.models.attention import BatchLayout
from app.models.lora_batch import LoraBatch


@dataclass
class StepInputs:
    """One forward pass, as every shard needs it: CPU tensors, small and picklable."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, or (3, T) with 3-D rotary positions (mrope.py)
    layout: BatchLayout
    logits_rows: torch.Tensor  # (S',) int64: rows of the batch whose next token is sampled
    copies: list[tuple[int, int]]  # (src, dst) blocks to copy first (copy-on-write)
    images: tuple[torch.Tensor, torch.Tensor] | None = None  # rows fed encoder rows, those
    lora: LoraBatch | None = None  # the rows' adapters (never under tensor parallelism)

    @property
    def is_all_decode(self) -> bool:
        return self.layout.num_decodes == len(self.layout.query_lens)


class InputBatch:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int) -> None:
        """`max_blocks`: blocks a sequence may hold at most (the model's length); rows
        start narrower and widen on demand, so a long-context model costs nothing until
        its sequences grow."""
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._tables = np.zeros((max_rows, min(max_blocks, 64)), dtype=np.int32)
        self._synced = [0] * max_rows  # entries of each row that hold its table
        self._rows: dict[int, int] = {}  # seq_id -> row
        self._free_rows = list(range(max_rows - 1, -1, -1))  # popped from the end: row 0 first
        self._adapters = StepAdapters()

    def __len__(self) -> int:
        return len(self._rows)

    def prepare(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Sequence]]:
        """The step's inputs, decodes first, and the sequences sampled after it (those
        whose prompt is then fully computed), in logits-row order."""
        for seq_id in batch.left:
            self._release(seq_id)
        decodes = [i for i, n in enumerate(batch.num_new_tokens) if n == 1]
        adapters = any(seq.lora is not None for seq in batch.seqs)
        if len(decodes) == len(batch.seqs) and not adapters:
            return self._decode_step(batch)
        prefills = [i for i, n in enumerate(batch.num_new_tokens) if n != 1]
        if adapters:  # each adapter's rows in runs (app.models.lora)
            decodes, prefills = (adapter_order(batch.seqs, i) for i in (decodes, prefills))
        # Those that see an image both ways go last: the attention backend's kernels take
        # the others (BatchLayout.both_ways).
        both = [i for i in prefills if sees_both_ways(batch.seqs[i], batch.num_new_tokens[i])]
        order = decodes + [i for i in prefills if i not in both] + both
        seqs = [batch.seqs[i] for i in order]
        counts = [batch.num_new_tokens[i] for i in order]
        rows = [self._sync(seq, batch.tables_changed) for seq in seqs]
        starts = [seq.num_computed_tokens for seq in seqs]
        input_ids: list[int] = []
        for seq, start, n in zip(seqs, starts, counts, strict=True):
            input_ids += seq.token_ids[start : start + n]
            if seq.draft:  # a proposal after the last token: its rows are all sampled
                input_ids += seq.draft
        n_arr = np.array(counts, dtype=np.int64)
        ends = np.cumsum(n_arr)  # one past each sequence's last token in the flat batch
        token_rows = np.repeat(np.array(rows, dtype=np.int64), n_arr)
        offsets = np.arange(int(ends[-1])) - np.repeat(ends - n_arr, n_arr)
        positions = np.repeat(np.array(starts, dtype=np.int64), n_arr) + offsets
        lens = [s + n for s, n in zip(starts, counts, strict=True)]
        due = [i for i, seq in enumerate(seqs) if lens[i] == seq.num_tokens + len(seq.draft)]
        layout = (counts, lens, len(decodes))
        inputs = self._inputs(
            batch, input_ids, rows, token_rows, positions, layout, _rows(seqs, due, ends)
        )
        inputs.images = step_rows(seqs, starts, counts)
        inputs.lora = self._adapters(seqs, counts)
        if (rope := step_positions(seqs, starts, counts, positions)) is not None:
            inputs.positions = torch.from_numpy(np.ascontiguousarray(rope))
        if both_ways := both_ways_spans(seqs, starts, counts):
            inputs.layout = replace(inputs.layout, both_ways=both_ways)
        return inputs, [seqs[i] for i in due]

    def _decode_step(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Sequence]]:
        """Every sequence computes one token: the common step, without the general
        case's repeats and offsets."""
        seqs, changed = batch.seqs, batch.tables_changed
        rows = [self._sync(seq, changed) for seq in seqs]
        positions = [seq.num_computed_tokens for seq in seqs]
        input_ids = [seq.token_ids[p] for seq, p in zip(seqs, positions, strict=True)]
        row_arr = np.array(rows, dtype=np.int64)
        pos_arr = np.array(positions, dtype=np.int64)
        lens = [p + 1 for p in positions]
        # a decode's token is its sequence's last: each is sampled unless still a prompt
        due = [i for i, seq in enumerate(seqs) if lens[i] == seq.num_tokens]
        logits_rows = np.array(due, dtype=np.int64)
        sampled = seqs if len(due) == len(seqs) else [seqs[i] for i in due]
        layout = ([1] * len(seqs), lens, len(seqs))
        inputs = self._inputs(batch, input_ids, rows, row_arr, pos_arr, layout, logits_rows)
        if any(seq.images for seq in seqs):  # a prompt's last token can be its image's
            inputs.images = step_rows(seqs, positions, [1] * len(seqs))
            if (rope := step_positions(seqs, positions, [1] * len(seqs), pos_arr)) is not None:
                inputs.positions = torch.from_numpy(np.ascontiguousarray(rope))
        return inputs, sampled

    def _inputs(
        self,
        batch: ScheduledBatch,
        input_ids: list[int],
        rows: list[int],
        token_rows: np.ndarray,  # (T,) the row of each token's sequence
        positions: np.ndarray,  # (T,)
        lens: tuple[list[int], list[int], int],  # query lens, context lens, decodes
        logits_rows: np.ndarray,  # (S',) flat-batch rows of the sampled sequences
    ) -> StepInputs:
        query_lens, context_lens, num_decodes = lens
        bs = self.block_size
        slots = self._tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        nblk = -(-max(context_lens) // bs)
        tables = self._tables[np.array(rows, dtype=np.int64), :nblk]  # (S, nblk) a copy
        layout = BatchLayout(
            query_lens,
            context_lens,
            torch.from_numpy(tables),
            torch.from_numpy(slots),
            num_decodes,
            bs,
        )
        return StepInputs(
            torch.tensor(input_ids, dtype=torch.long),
            torch.from_numpy(positions),
            layout,
            torch.from_numpy(np.asarray(logits_rows, dtype=np.int64)),
            [(c.src, c.dst) for c in batch.copies],
        )

    # ---- rows -----------------------------------------------------------------------
    def _sync(self, seq: Sequence, changed: set[int]) -> int:
        """`seq`'s row, with its block table written up to date."""
        row = self._rows.get(seq.seq_id)
        table = seq.block_table
        if row is None:
            if not self._free_rows:
                self._add_rows()
            row = self._rows[seq.seq_id] = self._free_rows.pop()
            done = 0
        else:
            done = 0 if seq.seq_id in changed else self._synced[row]
        if done < len(table):
            if len(table) > self._tables.shape[1]:
                self._widen(len(table))
            self._tables[row, done : len(table)] = table[done:]
            self._synced[row] = len(table)
        return row

    def _release(self, seq_id: int) -> None:
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._synced[row] = 0
            self._free_rows.append(row)

    def _add_rows(self) -> None:
        """More rows than max_num_seqs never run at once; this only keeps a broken
        promise from failing a step."""
        old = self._tables.shape[0]
        self._tables = np.concatenate([self._tables, np.zeros_like(self._tables)])
        self._synced += [0] * old
        self._free_rows += range(2 * old - 1, old - 1, -1)

    def _widen(self, needed: int) -> None:
        width = min(max(needed, 2 * self._tables.shape[1]), max(self.max_blocks, needed))
        wider = np.zeros((self._tables.shape[0], width), dtype=np.int32)
        wider[:, : self._tables.shape[1]] = self._tables
        self._tables = wider


def _rows(seqs: list[Sequence], due: list[int], ends: np.ndarray) -> np.ndarray:
    """The flat-batch rows sampled: each due sequence's last, and with a proposal, the
    rows of its last token and each proposed one (in order)."""
    if not any(seqs[i].draft for i in due):
        return ends[due] - 1
    rows = [np.arange(ends[i] - 1 - len(seqs[i].draft), ends[i]) for i in due]
    return np.concatenate(rows)
