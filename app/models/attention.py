"""The attention backend interface: how a model reads and writes the paged KV cache.

The model runner describes each forward once as a BatchLayout; the backend turns it
into whatever metadata its kernels need (`build_metadata`, once per step) and then
runs every layer's attention with it (`forward`). Backends own the KV cache layout.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class BatchLayout:
    """One forward pass, sequence by sequence.

    Invariants: sequences with one query token (decodes) come first, `num_decodes` of
    them; query tokens are laid out sequence after sequence in that order; a sequence's
    query tokens are the last `query_lens[i]` of its `context_lens[i]` cached tokens;
    row i of `block_tables` starts with the blocks holding those tokens, and any entry
    past them is some valid block (kernels read only up to a context's length).
    Lists given for the two tensors (tests) are converted, the tables padded with 0.
    """

    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # (S, nblk) int32 on the CPU
    slot_mapping: torch.Tensor  # (T,) int64 on the CPU: block * block_size + offset
    num_decodes: int
    block_size: int
    # (sequence, start, end): spans of positions whose queries see each other both ways
    # (Gemma 3's image tokens), each whole in its sequence's query tokens; only backends
    # with `sees_both_ways` are given any.
    both_ways: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.block_tables, list):
            padded = padded_block_tables(self.block_tables, self.context_lens, self.block_size)
            object.__setattr__(self, "block_tables", torch.tensor(padded, dtype=torch.int32))
        if isinstance(self.slot_mapping, list):
            object.__setattr__(self, "slot_mapping", torch.tensor(self.slot_mapping).long())

    def both_ways_of(self, seq: int) -> tuple[tuple[int, int], ...]:
        """The (start, end) spans of `both_ways` in sequence `seq`."""
        return tuple((a, b) for i, a, b in self.both_ways if i == seq)

    def tables(self, lo: int, hi: int) -> torch.Tensor:
        """(hi - lo, nblk) int32: the block tables of sequences lo..hi, cut to the blocks
        the longest of their contexts needs."""
        nblk = -(-max(self.context_lens[lo:hi]) // self.block_size)
        return self.block_tables[lo:hi, :nblk].contiguous()  # as kernels index it


def padded_block_tables(
    tables: list[list[int]], lens: list[int], block_size: int
) -> list[list[int]]:
    """Each table cut or padded (with block 0) to the blocks the longest context needs."""
    nblk = max((n + block_size - 1) // block_size for n in lens)
    return [t[:nblk] + [0] * (nblk - len(t[:nblk])) for t in tables]


@dataclass(frozen=True)
class DecodeInputs:
    """A step of decodes as paged_decode_attention takes it, and where their keys go."""

    slots: torch.Tensor  # (T,) int64 cache slots of the step's tokens
    tables: torch.Tensor  # (T, blocks) int32 block tables, padded with 0
    lens: torch.Tensor  # (T,) int32 cached tokens including this step's


class AttentionBackend(ABC):
    name: str = "abstract"
    sees_both_ways: bool = False  # honours BatchLayout.both_ways

    @abstractmethod
    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's K (and, separately, V) cache tensor."""

    @abstractmethod
    def build_metadata(self, layout: BatchLayout, num_kv_heads: int, device: torch.device) -> Any:
        """Tensors shared by every layer of one forward pass."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (T, nh, hd)
        k: torch.Tensor,  # (T, nkv, hd)
        v: torch.Tensor,  # (T, nkv, hd)
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Write k and v into the cache, then attend; returns (T, nh, hd).

        A query at position p sees the cached keys j <= p, and those of a `both_ways`
        span it is in; with `window` > 0 only those with p - j < window (sliding-window
        attention; 0: no limit). With `softcap` > 0,
        scores (already scaled) become softcap * tanh(score / softcap) before masking and
        softmax (Gemma 2's logit capping; 0: off). One metadata object serves every layer
        of a forward whatever its window, so window-dependent state is built on demand.
        """

    def decode_metadata(self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> Any:
        """Metadata of an all-decode step from tensors already on the device: slots (B,) int64,
        tables (B, nblk) int32, lens (B,) int32. Device ops only (no host sync, no shape
        that depends on values), so a CUDA graph can capture a forward that uses it."""
        raise NotImplementedError(f"the {self.name} attention backend builds no decode metadata")

    def decode_inputs(self, metadata: Any) -> "DecodeInputs | None":
        """Where every token of the step is a decode the CPU kernels attend, what they
        take (fused decode layers run such steps in one call per layer); else None."""
        return None

    def copy_blocks(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Copy whole blocks (copy-on-write). Blocks are the leading dimension by default."""
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]
