"""The second KV tier (app/engine/kv_tier.py): blocks the cache reallocates keep their KV
there, a prefix the cache lost is read back from it, and what comes back is exactly
what was computed (the same greedy tokens as an engine that recomputes)."""

import pytest
import torch

from app.engine.block_manager import BlockManager, chain_hash
from app.engine.kv_tier import KVTier
from app.engine.sequence import Sequence
from app.protocol import SamplingParams
from app.protocol.messages import ContextAction, ContextOp
from tests.engine.test_contexts import run
from tests.helpers import tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _caches(blocks: int, layers: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    k = [torch.zeros(blocks, 4, 2, 3) for _ in range(layers)]  # (blocks, tokens, heads, dim)
    v = [torch.zeros(blocks, 4, 2, 3) for _ in range(layers)]
    return k, v


def _computed(bm: BlockManager, k, v, tokens: list[int], rid: str) -> Sequence:  # noqa: ANN001
    """A sequence whose prompt's blocks hold KV that names them (block id + layer)."""
    seq = Sequence(rid, tokens, SamplingParams())
    bm.allocate_cached_prefix(seq)
    bm.append_slots(seq, len(tokens) - seq.num_computed_tokens)
    for layer in range(len(k)):
        for block in seq.block_table:
            k[layer][block] = 1000 * layer + block
            v[layer][block] = -(1000 * layer + block)
    seq.num_computed_tokens = len(tokens)
    bm.register_computed(seq)
    return seq


def test_saves_are_copied_together_and_a_reused_slot_keeps_the_last_block():
    """`save` only books a slot; `flush` copies every booked block at once. With one
    slot, two saves before a flush leave the second block's KV there."""
    k, v = _caches(2)
    k[0][0], k[0][1], v[1][1] = 1.0, 2.0, -2.0
    tier = KVTier(k, v, capacity_bytes=2 * 2 * 4 * 2 * 3 * 4)  # one block's bytes
    tier.save(0, 7, (7,))
    tier.save(1, 8, (8,))
    assert not tier.holds(7, (7,)) and tier.holds(8, (8,))
    kv = tier.fetch([8])  # flushes first
    assert torch.equal(kv[0, 0, 0], k[0][1]) and torch.equal(kv[0, 1, 1], v[1][1])


@pytest.mark.parametrize("on_disk", [False, True])
def test_a_reallocated_block_comes_back_from_the_tier(tmp_path, on_disk):
    k, v = _caches(4)
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.tier = KVTier(k, v, capacity_bytes=10**6, directory=tmp_path if on_disk else None)
    prompt = list(range(10, 19))  # two full blocks and a token
    first = _computed(bm, k, v, prompt, "a")
    kept = {
        (layer, i): k[layer][b].clone()
        for layer in range(2)
        for i, b in enumerate(first.block_table[:2])
    }
    bm.free(first)
    other = _computed(bm, k, v, list(range(50, 66)), "b")  # takes all 4 blocks
    assert bm.tier.stats.saved_blocks == 2 and not list(tmp_path.iterdir())  # file unlinked
    bm.free(other)
    again = Sequence("c", prompt, SamplingParams())
    bm.allocate_cached_prefix(again)
    assert again.num_computed_tokens == 8  # both full blocks, from the tier
    assert bm.tier_hit_tokens == 8 and bm.prefix_hit_tokens == 0
    for layer in range(2):
        for i, b in enumerate(again.block_table):
            assert torch.equal(k[layer][b], kept[(layer, i)])
    # Registered again as prefix hits of the cache itself.
    fourth = Sequence("d", prompt, SamplingParams())
    bm.allocate_cached_prefix(fourth)
    assert fourth.block_table == again.block_table and bm.prefix_hit_tokens == 8


def test_the_tier_is_bounded_least_recently_used_out_and_checks_tokens():
    k, v = _caches(2)
    per_block = 2 * 2 * 4 * 2 * 3 * 4  # K and V, 2 layers, 4 tokens x 2 heads x 3, float32
    tier = KVTier(k, v, capacity_bytes=2 * per_block)
    assert tier.stats.capacity_blocks == 2 and tier.bytes_per_block == per_block
    for n, h in enumerate((1, 2, 3)):
        tier.save(n % 2, h, (h,))
    assert not tier.holds(1, (1,)) and tier.holds(2, (2,)) and tier.holds(3, (3,))
    assert not tier.holds(2, (99,))  # a hash collision is not a hit
    assert tier.stats.dropped_blocks == 1 and tier.stats.held_bytes == 2 * per_block
    assert chain_hash(None, (1,)) != chain_hash(0, (1,))


def test_contexts_over_committed_4x_read_back_from_the_tier_exactly(tiny_llama):
    """20-token contexts, eight of them, over a cache of 10 blocks of 4 (40 tokens): each
    turn evicts others. With the tier a returning context reads its blocks back; without
    it recomputes them. The tokens are the same."""
    prompts = {f"c{i}": [7 + i] + list(range(60 + 20 * i, 79 + 20 * i)) for i in range(8)}

    def turns(tier: bool) -> tuple[dict[str, list[int]], dict]:
        engine = tiny_engine(
            tiny_llama, num_kv_blocks=10, block_size=4, kv_offload="memory" if tier else "off"
        )
        out: dict[str, list[int]] = {}
        for turn in range(3):
            for cid, prompt in prompts.items():
                op = ContextOp(cid, ContextAction.GENERATE)
                tokens = prompt if turn == 0 else [5 + turn]
                out[cid] = out.get(cid, []) + run(engine, f"{cid}-{turn}", op, tokens, GREEDY)
        return out, engine.stats_snapshot()

    with_tier, stats = turns(True)
    without, plain = turns(False)
    assert with_tier == without
    assert stats["kv_tier_hit_tokens"] > 0 and stats["kv_tier_saved_blocks"] > 0
    assert plain["kv_tier_hit_tokens"] == 0
    # What the tier gave back was not computed again.
    assert stats["num_prompt_tokens"] + stats["kv_tier_hit_tokens"] == plain["num_prompt_tokens"]
    assert stats["num_prompt_tokens"] < plain["num_prompt_tokens"] / 2, (stats, plain)


def test_a_disk_tier_reserves_its_bytes_and_stops_growing_when_the_disk_is_full(
    tmp_path, monkeypatch
):
    # Its file was sparse: a write into a hole on a full disk kills the process (SIGBUS).
    import errno
    import os

    from app.engine import kv_tier

    k, v = _caches(2)
    tier = KVTier(k, v, capacity_bytes=10**6, directory=tmp_path)
    calls = []

    def full_after_one(fd: int, offset: int, length: int) -> None:
        calls.append((offset, length))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(kv_tier.os, "posix_fallocate", full_after_one)
    monkeypatch.setattr(kv_tier, "RESERVE_SLOTS", 3)
    for h in range(1, 6):
        tier.save(0, h, (h,))
    assert calls[0] == (0, 3 * tier.bytes_per_block)
    assert tier.stats.capacity_blocks == 3 and len(tier) == 3  # the reserved ones, LRU
    assert tier.holds(5, (5,)) and not tier.holds(1, (1,))
