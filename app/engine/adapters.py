"""The LoRA adapters an engine holds, and a step's rows grouped by adapter.

At most `max_loras` adapters are held (their weights in the model's dtype on its
device); loading one more drops the least recently used, which is read again from its
directory when a request names it. A request takes its adapter at
admission into the engine and keeps it to its end, so dropping one never changes a
request under way: its weights are freed when its last request ends (and the step's
stack of adapters, StepAdapters, lets them go: at the next set of stacked adapters, or
the next step without any).
"""

import logging
from collections import OrderedDict
from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np
import torch

from app.engine.sequence import Sequence
from app.models.loader import LoadedModel
from app.models.lora import LoraAdapter, LoraError, load_adapter
from app.models.lora_batch import MIN_ROWS, LoraBatch, StackedLoras
from app.protocol.errors import InvalidRequestError, NotFoundError, UnavailableError
from app.protocol.lora_ids import shown

logger = logging.getLogger(__name__)


class AdapterTable:
    def __init__(self, loaded: LoadedModel, max_loras: int, loras: dict[str, str]) -> None:
        """`loras`: name -> directory, loaded now."""
        self.model, self.dtype, self.max_loras = loaded.model, loaded.dtype, max_loras
        self._held: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recent first
        # Every adapter this engine may run, held or not: one dropped for room is read
        # again when a request names it.
        self._paths: dict[str, str] = {}
        for name, path in loras.items():
            self.hold(name, path, self.read(name, path))

    def names(self) -> list[str]:
        return list(self._held)

    def holds(self, name: str, path: str | Path) -> bool:
        return name in self._held and self._paths.get(name) == str(path)

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """The adapter at `path` (InvalidRequestError when it cannot be read or does not
        fit the model); nothing held changes, so it may run outside the engine's lock."""
        if self.max_loras < 1:
            raise InvalidRequestError("LoRA adapters are off (engine.max_loras is 0)", "lora")
        device = self.model.model.norm.weight.device  # a float parameter, quantized or not
        try:
            return load_adapter(name, path, self.model, self.dtype, device)
        except LoraError as exc:
            raise InvalidRequestError(f"LoRA adapter {shown(name)!r}: {exc}", "lora_path") from exc

    def hold(self, name: str, path: str | Path, adapter: LoraAdapter) -> None:
        """Hold `adapter`, read from `path`, as `name` (replacing one of that name); the
        least recently used adapter goes when more than max_loras would be held."""
        self._paths[name] = str(path)
        self._held.pop(name, None)
        self._held[name] = adapter
        while len(self._held) > self.max_loras:
            self._held.popitem(last=False)

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        self.hold(name, path, adapter := self.read(name, path))
        return adapter

    def forget(self, name: str) -> None:
        """Run `name` no more (requests under way keep it)."""
        if self._paths.pop(name, None) is None:
            raise NotFoundError(f"no LoRA adapter {shown(name)!r} is loaded", "lora_name")
        self._held.pop(name, None)

    def take(self, name: str) -> LoraAdapter:
        """The adapter a new request runs with, now the most recently used (read again
        if it was dropped for room)."""
        adapter = self._held.get(name)
        if adapter is None:
            if name not in self._paths:
                raise NotFoundError(f"no LoRA adapter {shown(name)!r} is loaded", "model")
            try:
                return self.load(name, self._paths[name])
            except InvalidRequestError as exc:  # read once, so the server's fault now
                logger.warning("LoRA adapter %s: %s", name, exc.message)
                raise UnavailableError(f"LoRA adapter {shown(name)!r} cannot be read now") from None
        self._held.move_to_end(name)
        return adapter


def adapter_order(seqs: Seq[Sequence], indices: list[int]) -> list[int]:
    """`indices` of `seqs` with the sequences of one adapter next to each other (the base
    model's first), otherwise in their order."""
    return sorted(indices, key=lambda i: 0 if seqs[i].lora is None else seqs[i].lora.uid)


class StepAdapters:
    """A step's LoraBatch (app.models.lora_batch), keeping the stack of the last step's
    stacked adapters for the next while they stay the same."""

    # stacked while the blocks hold at most this many rows for each real one
    MAX_PADDING = 2

    def __init__(self) -> None:
        self._stacked: StackedLoras | None = None

    def __call__(self, seqs: Seq[Sequence], counts: Seq[int]) -> LoraBatch | None:
        """The sequences in batch order, `counts` tokens each; None when none runs an
        adapter."""
        if all(seq.lora is None for seq in seqs):
            self._stacked = None
            return None
        rows: dict[int, list[int]] = {}
        adapters: dict[int, LoraAdapter] = {}
        row = 0
        for seq, n in zip(seqs, counts, strict=True):
            if (lora := seq.lora) is not None:
                adapters[lora.uid] = lora
                rows.setdefault(lora.uid, []).extend(range(row, row + n))
            row += n
        stacked = self._stack(adapters, rows)
        runs = tuple(_runs(seqs, counts, set(stacked.uids) if stacked else set()))
        if stacked is None:
            return LoraBatch(runs)
        widest = max(MIN_ROWS, *(len(rows[uid]) for uid in stacked.uids))
        gather = np.full((len(stacked.uids), widest), row, dtype=np.int64)  # row: past all
        for i, uid in enumerate(stacked.uids):
            gather[i, : len(rows[uid])] = rows[uid]
        if gather.size == row and (gather.ravel() == np.arange(row)).all():
            return LoraBatch(runs, stacked)  # blocks are views of the step's rows
        places = np.flatnonzero(gather.ravel() != row)
        real = (torch.from_numpy(places), torch.from_numpy(gather.ravel()[places]))
        return LoraBatch(runs, stacked, torch.from_numpy(gather.ravel()), real)

    def _stack(self, adapters: dict[int, LoraAdapter], rows: dict[int, list[int]]):  # noqa: ANN202
        """The stack of the step's largest set of adapters of one signature, if two or
        more and evenly spread enough; None otherwise."""
        groups: dict[tuple, list[int]] = {}
        for uid, adapter in adapters.items():
            groups.setdefault(adapter.signature, []).append(uid)
        uids = tuple(sorted(max(groups.values(), key=len)))
        widest = max(len(rows[uid]) for uid in uids)
        if len(uids) < 2 or len(uids) * widest > self.MAX_PADDING * sum(len(rows[u]) for u in uids):
            return None
        if self._stacked is None or self._stacked.uids != uids:
            self._stacked = StackedLoras.of([adapters[uid] for uid in uids])
        return self._stacked


def _runs(seqs: Seq[Sequence], counts: Seq[int], stacked: set[int]):  # noqa: ANN202
    """(adapter, first row, one past last) of each run of consecutive rows of one adapter
    that is not stacked."""
    run = None
    row = 0
    for seq, n in zip(seqs, counts, strict=True):
        lora = seq.lora
        if lora is not None and lora.uid not in stacked:
            if run is not None and run[0] is lora and run[2] == row:
                run = (lora, run[1], row + n)
            else:
                if run is not None:
                    yield run
                run = (lora, row, row + n)
        row += n
    if run is not None:
        yield run
