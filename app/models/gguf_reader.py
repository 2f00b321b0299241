"""gguf's own reader, parsing a file's header about four times faster.

`gguf.GGUFReader` maps the file as a `numpy.memmap` and slices it once per value: twice
per string of the vocabulary and its merges, half a million slices for a 49k-token
model. Each slice of a memmap runs two Python-level methods of numpy's subclass, which
is most of the 2 s it takes to open SmolLM2's file. `QuickGGUFReader` slices a plain
ndarray view of the same mapping (the memmap stays its base, so the mapping lives as
long as any view) and builds the same fields, parts and tensors.

transformers opens GGUF files itself (`AutoConfig`, `AutoTokenizer`, `AutoModel...`
with `gguf_file=`) through `gguf.GGUFReader`, with no way to hand it a reader, so
`quick_gguf_reads()` makes the quick one the module's. It is a subclass that returns
equal values, so code that made a reader before, or checks `isinstance`, is unaffected.
"""

from typing import Any

import gguf
import numpy as np


class QuickGGUFReader(gguf.GGUFReader):
    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._data = mapped.view(np.ndarray)

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None
    ) -> np.ndarray:
        dtype, count = np.dtype(dtype), int(count)
        values = self._data[offset : offset + dtype.itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return values if order == "I" else values.view(dtype.newbyteorder(order))


_original_reader = gguf.GGUFReader


def quick_gguf_reads() -> type[QuickGGUFReader]:
    """Make `gguf.GGUFReader` the quick reader (for transformers' loads too); idempotent."""
    if gguf.GGUFReader is _original_reader:
        gguf.GGUFReader = QuickGGUFReader
    return QuickGGUFReader
