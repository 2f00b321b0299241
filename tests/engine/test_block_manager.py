import pytest

from app.engine.block_manager import BlockManager
from app.engine.sequence import Sequence
from app.protocol import SamplingParams


def seq(tokens: list[int], n: int = 1) -> Sequence:
    return Sequence("r", tokens, SamplingParams(max_tokens=4, n=n))


def compute(bm: BlockManager, s: Sequence, n: int) -> None:
    """What the scheduler and runner do for one step of n tokens."""
    bm.append_slots(s, n)
    s.num_computed_tokens += n
    bm.register_computed(s)


def test_allocation_and_accounting():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(list(range(10)))
    bm.allocate_cached_prefix(s)
    assert s.num_computed_tokens == 0
    assert bm.can_append(s, 10)
    compute(bm, s, 10)
    assert len(s.block_table) == 3  # ceil(10 / 4)
    st = bm.stats()
    assert (st.total, st.used, st.free) == (8, 3, 5)
    assert st.cached == 0  # registered blocks in use are not counted as cached
    bm.free(s)
    st = bm.stats()
    assert (st.used, st.free, st.cached) == (0, 8, 2)  # two full blocks stay reusable


def test_cannot_append_beyond_free_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(list(range(12)))
    assert bm.blocks_to_append(s, 12) == 3
    assert not bm.can_append(s, 12)
    assert bm.can_append(s, 8)


def test_prefix_hit_reuses_blocks_and_leaves_one_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(12)))
    bm.allocate_cached_prefix(a)
    compute(bm, a, 12)
    b = seq(list(range(8)) + [99, 98, 97])  # shares two full blocks with a
    bm.allocate_cached_prefix(b)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert b.block_table == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    c = seq(list(range(12)))  # identical prompt: the last block is recomputed for logits
    bm.allocate_cached_prefix(c)
    assert c.num_computed_tokens == 8
    assert bm.stats().prefix_hit_tokens == 16


def test_prefix_hit_survives_free_until_evicted():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(9)))
    bm.allocate_cached_prefix(a)
    compute(bm, a, 9)
    bm.free(a)
    b = seq(list(range(9)))
    bm.allocate_cached_prefix(b)
    assert b.num_computed_tokens == 8  # both full blocks came back from the free list
    bm.free(b)
    # Fill the whole cache with other tokens: every cached block is evicted.
    c = seq([50 + i for i in range(16)])
    bm.allocate_cached_prefix(c)
    compute(bm, c, 16)
    bm.free(c)
    d = seq(list(range(9)))
    bm.allocate_cached_prefix(d)
    assert d.num_computed_tokens == 0


def test_hash_collision_is_checked_against_tokens():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3])
    bm.allocate_cached_prefix(a)
    compute(bm, a, 3)
    block = bm.blocks[a.block_table[0]]
    block.token_ids = (7, 7)  # pretend the hash now points at other tokens
    b = seq([1, 2, 5])
    bm.allocate_cached_prefix(b)
    assert b.num_computed_tokens == 0


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq(list(range(6)), n=2)
    bm.allocate_cached_prefix(parent)
    compute(bm, parent, 6)  # blocks: [full, half]
    child = parent.fork(1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert all(bm.blocks[b].ref_count == 2 for b in parent.block_table)
    used_before = bm.stats().used
    child.token_ids.append(42)
    cow = bm.append_slots(child, 1)  # writes into the shared half block
    assert cow is not None and cow.src == parent.block_table[1]
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] == cow.dst != cow.src
    assert bm.blocks[cow.src].ref_count == 1
    assert bm.stats().used == used_before + 1
    parent.token_ids.append(43)
    assert bm.append_slots(parent, 1) is None  # the parent now owns its block alone


def test_free_of_parent_keeps_shared_blocks_for_child():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq(list(range(8)), n=2)
    bm.allocate_cached_prefix(parent)
    compute(bm, parent, 8)
    child = parent.fork(1)
    bm.fork(parent, child)
    bm.free(parent)
    assert all(bm.blocks[b].ref_count == 1 for b in child.block_table)
    bm.free(child)
    assert bm.stats().used == 0 and bm.num_free_blocks == 8


@pytest.mark.parametrize("caching", [True, False])
def test_every_block_returns(caching: bool):
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=caching)
    seqs = [seq(list(range(i, i + 13))) for i in range(5)]
    for s in seqs:
        bm.allocate_cached_prefix(s)
        compute(bm, s, 13)
    for s in seqs:
        bm.free(s)
    st = bm.stats()
    assert st.used == 0 and st.free == 32
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_the_cached_count_is_kept_without_scans():
    """stats() reads counters; they must equal what a scan of the free blocks finds after
    allocations, prefix hits, forks, copy-on-write and reuse of cached blocks."""
    bm = BlockManager(num_blocks=12, block_size=4)

    def scanned() -> int:
        return sum(1 for b in bm._free if bm.blocks[b].hash is not None)

    a, b = seq(list(range(13))), seq(list(range(13)) + [99])
    for s in (a, b):
        bm.allocate_cached_prefix(s)
        compute(bm, s, s.num_tokens - s.num_computed_tokens)
        assert bm.stats().cached == scanned()
    child = seq([])
    bm.fork(b, child)
    bm.free(a)
    assert bm.stats().cached == scanned()
    bm.free(b)
    bm.free(child)
    assert bm.stats().cached == scanned() > 0
    big = seq(list(range(100, 140)))  # 10 of the 12 blocks: evicts one cached prefix block
    bm.allocate_cached_prefix(big)
    compute(bm, big, 40)
    assert bm.stats().cached == scanned() == 2
    bm.free(big)
    assert bm.stats().cached == scanned() == 12
