"""KVTier: a second, slower home for the KV of blocks the cache lets go (SGLang's
HiCache, vLLM's CPU offload, in miniature).

A full block whose KV was computed is registered by its prefix hash (BlockManager); when
it is freed it stays in the cache as a prefix hit until its slot is taken for other
tokens. Then, instead of losing it, the block manager hands it here: its K and V are
copied into a slot of the tier, keyed by the same hash (and checked against the same
tokens, as the cache checks its own hits). A later prompt whose prefix runs past what
the cache still holds reads the next blocks back from the tier into fresh cache blocks,
and computes only from where the tier, too, stops.

What it holds: a fixed number of block slots, `capacity_bytes` of them, least recently
used out first. Where: host memory (`directory` None; pinned on a GPU replica, whose
cache is device memory), or a file in `directory` (a CPU replica, whose cache is already
host memory: the tier is the local disk, through the page cache). The file is unlinked
as soon as it is mapped: nothing is left behind, whatever becomes of the process.

Idle contexts' KV goes the same way: evicting a context frees its blocks (its tokens
stay), and its next turn finds them again in the cache, or here. Only the last, partly
filled block of a context is not kept (it has no hash yet): at most a block's tokens are
computed again.

Plain Python and torch, under the engine's lock like the block manager: the blocks of one
allocation are copied together, a gather per layer; the kernel writes a file tier's pages
back in the background.
"""

import logging
import os
import tempfile
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from app.engine.config import EngineConfig
    from app.engine.model_runner import ModelRunner
    from app.models.parallel import TPGroup

logger = logging.getLogger(__name__)
RESERVE_SLOTS = 64  # a file tier's slots reserved on the disk at a time


@dataclass
class TierStats:
    capacity_blocks: int = 0
    held_blocks: int = 0
    bytes_per_block: int = 0
    saved_blocks: int = 0  # written to the tier, all time
    hit_blocks: int = 0  # read back instead of computed, all time
    dropped_blocks: int = 0  # pushed out of the tier for newer ones
    write_s: float = 0.0
    read_s: float = 0.0

    @property
    def held_bytes(self) -> int:
        return self.held_blocks * self.bytes_per_block


class KVTier:
    def __init__(
        self,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        capacity_bytes: int,
        directory: str | Path | None = None,
    ) -> None:
        """`k_caches`, `v_caches`: the runner's cache tensors, one per layer, each
        (blocks, *block shape); the tier copies blocks out of them and back."""
        self.k_caches, self.v_caches = k_caches, v_caches
        self._fd: int | None = None
        first = k_caches[0]
        block = tuple(first.shape[1:])
        self.bytes_per_block = 2 * len(k_caches) * first[0].numel() * first.element_size()
        slots = max(0, capacity_bytes // self.bytes_per_block)
        shape = (slots, len(k_caches), 2, *block)
        if directory is None:
            pin = first.device.type == "cuda"
            self.slots = torch.empty(shape, dtype=first.dtype, pin_memory=pin)
            self.where = "memory"
        else:
            Path(directory).mkdir(parents=True, exist_ok=True)
            path = Path(directory) / f"shoal-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
            numel = slots * len(k_caches) * 2 * first[0].numel()
            mapped = torch.from_file(str(path), shared=True, size=numel, dtype=first.dtype)
            if slots:  # a descriptor of its own, to reserve the file's bytes as it grows
                self._fd = os.open(path, os.O_RDWR)
                weakref.finalize(self, os.close, self._fd)
            path.unlink(missing_ok=True)  # the mapping stays; the name goes now (none: size 0)
            self.slots = mapped.view(shape)
            self.where = str(directory)
        self._pending: list[tuple[int, int]] = []  # (cache block, slot) saved, not copied
        self._held: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # LRU first
        self._fresh = 0  # slots from here on were never written
        self._reserved = 0  # slots whose bytes the disk holds for the file (a file tier)
        self.stats = TierStats(capacity_blocks=slots, bytes_per_block=self.bytes_per_block)

    def __len__(self) -> int:
        return len(self._held)

    def save(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Keep cache block `block_id`'s KV (about to be taken for other tokens)."""
        if not self.stats.capacity_blocks:
            return
        if block_hash in self._held:
            self._held.move_to_end(block_hash)  # the same tokens' KV: the same bytes
            return
        started = time.perf_counter()
        slot = self._new_slot()
        if slot is None:
            if not self._held:
                return
            _, (slot, _) = self._held.popitem(last=False)
            self.stats.dropped_blocks += 1
        # Copied in `flush`, all blocks of one allocation at once: block by block, a GPU
        # replica would pay two copies per layer per block.
        self._pending.append((block_id, slot))
        self._held[block_hash] = (slot, token_ids)
        self.stats.saved_blocks += 1
        self.stats.held_blocks = len(self._held)
        self.stats.write_s += time.perf_counter() - started

    def flush(self) -> None:
        """Copy the blocks `save` was given into their slots: before anything writes
        those blocks again (the block manager calls it once an allocation is done)."""
        if not self._pending:
            return
        started = time.perf_counter()
        # a slot reused within one allocation holds the last block given it
        latest = {slot: block for block, slot in self._pending}
        self._pending.clear()
        slots, blocks = list(latest), list(latest.values())
        device = self.k_caches[0].device
        index = torch.tensor(blocks, dtype=torch.long, device=device)
        into = torch.tensor(slots, dtype=torch.long)
        pairs = list(zip(self.k_caches, self.v_caches, strict=True))
        if device.type == "cpu":
            for layer, (k, v) in enumerate(pairs):
                self.slots[into, layer, 0] = k.index_select(0, index)
                self.slots[into, layer, 1] = v.index_select(0, index)
        else:  # gathered on the device, then each block straight into its pinned slot
            staged = torch.stack(
                [
                    torch.stack((k.index_select(0, index), v.index_select(0, index)), dim=1)
                    for k, v in pairs
                ],
                dim=1,
            )  # (n, layers, 2, *block)
            # Queued on the stream, before any forward that overwrites the blocks, and
            # before any read of the slots (`fetch` copies on the same stream).
            for row, slot in enumerate(slots):
                self.slots[slot].copy_(staged[row], non_blocking=True)
        self.stats.write_s += time.perf_counter() - started

    def _new_slot(self) -> int | None:
        """A slot never written, None when all were. A file tier's slots get their bytes
        on the disk first, a chunk at a time (`posix_fallocate`): a write into a sparse
        file's hole on a full disk would kill the process (SIGBUS). A disk that has no
        more room leaves the tier the slots it has."""
        if self._fresh >= self.stats.capacity_blocks:
            return None
        if self._fd is not None and self._fresh >= self._reserved:
            chunk = min(RESERVE_SLOTS, self.stats.capacity_blocks - self._reserved)
            try:
                os.posix_fallocate(
                    self._fd, self._reserved * self.bytes_per_block, chunk * self.bytes_per_block
                )
            except OSError as exc:
                logger.warning(
                    "KV offload: the disk has no room for more (%s); keeping %d blocks",
                    exc,
                    self._reserved,
                )
                self.stats.capacity_blocks = self._reserved
                return None
            self._reserved += chunk
        self._fresh += 1
        return self._fresh - 1

    def holds(self, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        held = self._held.get(block_hash)
        return held is not None and held[1] == token_ids

    def fetch(self, hashes: list[int]) -> torch.Tensor:
        """A copy of the KV of blocks `hashes` (each `holds`), (n, layers, 2, *block), on
        the cache's device: a copy, since the cache blocks it goes into are taken after
        this, and taking them may push blocks into the tier, and others out of it. (On a
        GPU the copies are queued: `read_s` counts their issue, not their transfer.)"""
        self.flush()  # a block saved in this allocation may be one asked for
        started = time.perf_counter()
        slots = [self._held[h][0] for h in hashes]
        for h in hashes:
            self._held.move_to_end(h)
        device = self.k_caches[0].device
        if device.type == "cpu":
            kv = self.slots[torch.tensor(slots, dtype=torch.long)]
        else:  # straight from the pinned slots, each one contiguous, queued on the stream
            kv = torch.empty(
                (len(slots), *self.slots.shape[1:]), dtype=self.slots.dtype, device=device
            )
            for row, slot in enumerate(slots):
                kv[row].copy_(self.slots[slot], non_blocking=True)
        self.stats.hit_blocks += len(hashes)
        self.stats.read_s += time.perf_counter() - started
        return kv

    def install(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """`fetch`'s copy into cache blocks `block_ids`."""
        self.flush()  # the blocks may have been saved just now: their KV goes out first
        started = time.perf_counter()
        device = self.k_caches[0].device
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        kv = kv.to(device)  # one copy to a GPU; then one scatter per layer there
        for layer, (k, v) in enumerate(zip(self.k_caches, self.v_caches, strict=True)):
            k[index] = kv[:, layer, 0]
            v[index] = kv[:, layer, 1]
        self.stats.read_s += time.perf_counter() - started


def open_tier(config: "EngineConfig", runner: "ModelRunner", tp: "TPGroup") -> KVTier | None:
    """The engine's second tier as `config` asks (None: none)."""
    why = None
    if config.kv_offload == "off" or config.kv_offload_gib <= 0:
        return None
    if not config.enable_prefix_caching:
        why = "prefix caching is off"  # blocks without hashes: nothing to find them by
    elif tp.size > 1:
        why = "each shard holds part of the KV"  # the tier would hold rank 0's part only
    if why is not None:
        logger.info("KV offload off: %s", why)
        return None
    where = config.kv_offload
    if where == "auto":
        # A GPU's cache is device memory: host RAM is its next tier (pinned; read back
        # 1.9x faster than Llama-3-8B recomputes 2,048 tokens on an H200, 1.6x for
        # SmolLM2). A CPU's cache is host RAM already: the local disk, 31x (warm_state.py).
        where = "memory" if runner.device.type == "cuda" else "disk"
    directory = None
    if where == "disk":
        directory = Path(config.kv_offload_dir or tempfile.gettempdir()) / "shoal-kv"
    tier = KVTier(runner.k_caches, runner.v_caches, int(config.kv_offload_gib * 2**30), directory)
    logger.info(
        "KV offload: %d blocks (%.1f GiB) in %s",
        tier.stats.capacity_blocks,
        tier.stats.capacity_blocks * tier.bytes_per_block / 2**30,
        tier.where,
    )
    return tier
