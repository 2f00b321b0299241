"""BlockManager: fixed-size KV blocks with reference counts, prefix caching and copy-on-write.

Invariants:
- a block is either referenced (ref_count > 0) or in `_free` (ref_count == 0), never both;
- a free block may still hold a registered prefix (it is "cached"): reusing it for a new
  allocation evicts that prefix, least recently freed first;
- `_by_hash[h] == b` implies blocks[b].hash == h and blocks[b].token_ids are the tokens
  that hash was computed from (a hit is confirmed against them, never trusted alone);
- only full blocks whose KV has been computed are registered;
- `_num_cached == number of free blocks with a hash`, kept as blocks move in and out of
  `_free` (a block gets a hash only while referenced and loses it only when reallocated),
  so that stats cost nothing per step;
- with a `tier` (app/engine/kv_tier.py), a cached block's KV goes there when its block is
  reallocated, and a prefix the cache no longer holds is looked up there next.
"""

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from app.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class BlockStats:
    total: int
    free: int  # unreferenced, including cached
    cached: int  # unreferenced but holding a reusable prefix
    used: int  # referenced by at least one sequence
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0


@dataclass
class CopyOnWrite:
    src: int
    dst: int


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, token_ids))


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    blocks: list[Block] = field(init=False)
    _free: OrderedDict[int, None] = field(init=False)
    _by_hash: dict[int, int] = field(init=False)
    tier: Any = None  # an app.engine.kv_tier.KVTier (not imported: it imports the runner)
    prefix_hit_tokens: int = field(init=False, default=0)
    tier_hit_tokens: int = field(init=False, default=0)
    prefix_query_tokens: int = field(init=False, default=0)
    _num_cached: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free = OrderedDict((i, None) for i in range(self.num_blocks))
        self._by_hash = {}

    # ---- accounting -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def stats(self) -> BlockStats:
        return BlockStats(
            total=self.num_blocks,
            free=len(self._free),
            cached=self._num_cached,
            used=self.num_blocks - len(self._free),
            prefix_hit_tokens=self.prefix_hit_tokens,
            prefix_query_tokens=self.prefix_query_tokens,
        )

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- admission: reuse cached prefix blocks ---------------------------------
    def allocate_cached_prefix(self, seq: Sequence) -> None:
        """Give a sequence with no blocks the longest cached prefix of its tokens.

        At least one token is always left to compute, so the step that finishes the
        prompt has logits to sample from.
        """
        assert not seq.block_table, seq
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self.prefix_query_tokens += seq.num_tokens
        if not self.enable_prefix_caching:
            return
        prev = seq.cache_salt
        i = 0
        while i < max_blocks:
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(prev, tokens)
            block_id = self._by_hash.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            prev = h
            i += 1
        hits = i * self.block_size
        if self.tier is not None and i < max_blocks:
            self._load_from_tier(seq, i, max_blocks, prev)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self.prefix_hit_tokens += hits
        self.tier_hit_tokens += seq.num_computed_tokens - hits

    def _load_from_tier(self, seq: Sequence, start: int, stop: int, prev: int | None) -> None:
        """The blocks of `seq`'s prompt from block `start` on that the tier holds, read
        back into fresh blocks while there are free ones (each then a cached prefix like
        any computed block)."""
        tier = self.tier
        assert tier is not None
        hashes: list[int] = []
        for i in range(start, stop):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(prev, tokens)
            if not tier.holds(h, tokens) or len(self._free) <= len(hashes):
                break
            hashes.append(h)
            prev = h
        if not hashes:
            return
        kv = tier.fetch(hashes)  # first: taking fresh blocks may change what the tier holds
        fresh = [self._allocate_fresh() for _ in hashes]
        tier.install(fresh, kv)
        for n, (h, block_id) in enumerate(zip(hashes, fresh, strict=True)):
            i = start + n
            block = self.blocks[block_id]
            if h not in self._by_hash:
                block.hash = h
                block.token_ids = tuple(
                    seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
                )
                self._by_hash[h] = block_id
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)

    # ---- growth -------------------------------------------------------------------
    def blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks needed to compute `num_new_tokens` more tokens (incl. copy-on-write)."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return max(needed, 0) + (1 if self._needs_copy(seq) else 0)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_to_append(seq, num_new_tokens) <= len(self._free)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> CopyOnWrite | None:
        """Make room for the next `num_new_tokens` tokens; returns a block copy to perform
        before the forward pass when the partly-filled last block was shared."""
        cow = None
        if self._needs_copy(seq):
            last = len(seq.block_table) - 1
            src = seq.block_table[last]
            dst = self._allocate_fresh()
            self._release(src)
            seq.block_table[last] = dst
            cow = CopyOnWrite(src, dst)
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            seq.block_table.append(self._allocate_fresh())
        if self.tier is not None:
            self.tier.flush()  # the KV of blocks just taken, out before it is overwritten
        return cow

    def _needs_copy(self, seq: Sequence) -> bool:
        if seq.num_computed_tokens % self.block_size == 0:
            return False  # the next token starts a new block
        last = seq.block_table[seq.num_computed_tokens // self.block_size]
        return self.blocks[last].ref_count > 1

    # ---- after a step: register newly completed blocks ---------------------------
    def register_computed(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        prev = seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(prev, tokens)
            seq.block_hashes.append(h)
            prev = h
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self._by_hash:
                block.hash, block.token_ids = h, tokens
                self._by_hash[h] = block.block_id

    # ---- forks and release --------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; writes go through copy-on-write."""
        assert not child.block_table, child
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; last blocks first so that the prompt's head,
        most likely to be shared, is the last to be evicted."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    # ---- internals ----------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
            self._num_cached -= block.hash is not None
        block.ref_count += 1

    def _allocate_fresh(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.tier is not None:  # its KV outlives the block, one tier down
                self.tier.save(block_id, block.hash, block.token_ids)
            self._num_cached -= 1
            if self._by_hash.get(block.hash) == block_id:
                del self._by_hash[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, block
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            self._num_cached += block.hash is not None
