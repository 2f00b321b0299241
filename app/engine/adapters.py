"""The LoRA adapters an engine holds, and a step's rows grouped by adapter.

At most `max_loras` adapters are held (their weights in the model's dtype on its
device); loading one more drops the least recently used. A request takes its adapter at
admission into the engine and keeps it to its end, so dropping one never changes a
request under way: its weights are freed when its last request ends.
"""

from collections import OrderedDict
from collections.abc import Sequence as Seq
from pathlib import Path

from app.engine.sequence import Sequence
from app.models.loader import LoadedModel
from app.models.lora import LoraAdapter, LoraBatch, LoraError, load_peft_adapter
from app.protocol.errors import InvalidRequestError, NotFoundError


class AdapterTable:
    def __init__(self, loaded: LoadedModel, max_loras: int, loras: dict[str, str]) -> None:
        """`loras`: name -> directory, loaded now."""
        self.model, self.dtype, self.max_loras = loaded.model, loaded.dtype, max_loras
        self._held: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recent first
        for name, path in loras.items():
            self.load(name, path)

    def names(self) -> list[str]:
        return list(self._held)

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Read the adapter at `path` as `name` (replacing one of that name); the least
        recently used adapter goes when more than max_loras would be held."""
        if self.max_loras < 1:
            raise InvalidRequestError("LoRA adapters are off (engine.max_loras is 0)", "lora")
        device = self.model.model.norm.weight.device  # a float parameter, quantized or not
        try:
            adapter = load_peft_adapter(name, path, self.model, self.dtype, device)
        except LoraError as exc:
            raise InvalidRequestError(f"LoRA adapter {name!r}: {exc}", "lora_path") from exc
        self._held.pop(name, None)
        self._held[name] = adapter
        while len(self._held) > self.max_loras:
            self._held.popitem(last=False)
        return adapter

    def unload(self, name: str) -> None:
        if self._held.pop(name, None) is None:
            raise NotFoundError(f"no LoRA adapter {name!r} is loaded", "lora_name")

    def take(self, name: str) -> LoraAdapter:
        """The adapter a new request runs with, now the most recently used."""
        adapter = self._held.get(name)
        if adapter is None:
            raise NotFoundError(f"no LoRA adapter {name!r} is loaded", "model")
        self._held.move_to_end(name)
        return adapter


def adapter_order(seqs: Seq[Sequence], indices: list[int]) -> list[int]:
    """`indices` of `seqs` with the sequences of one adapter next to each other (the base
    model's first), otherwise in their order."""
    return sorted(indices, key=lambda i: 0 if seqs[i].lora is None else seqs[i].lora.uid)


def step_adapters(seqs: Seq[Sequence], counts: Seq[int]) -> LoraBatch | None:
    """The step's adapters, each with its runs of consecutive flat-batch rows (the
    sequences in batch order, `counts` tokens each); None when none runs one."""
    if all(seq.lora is None for seq in seqs):
        return None
    runs: list[tuple[LoraAdapter, int, int]] = []
    row = 0
    for seq, n in zip(seqs, counts, strict=True):
        if seq.lora is not None:
            if runs and runs[-1][0] is seq.lora and runs[-1][2] == row:
                runs[-1] = (seq.lora, runs[-1][1], row + n)
            else:
                runs.append((seq.lora, row, row + n))
        row += n
    return LoraBatch(tuple(runs))
