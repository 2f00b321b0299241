from deployments.prefix_index import PrefixIndex, block_keys


def test_block_keys_chain_full_blocks_only():
    a = block_keys(list(range(40)), 16, 4096)
    assert len(a) == 2  # 40 tokens: two full blocks of 16
    b = block_keys([99, *range(1, 40)], 16, 4096)
    assert a[0] != b[0] and a[1] != b[1]  # a different first block changes every key after
    assert len(block_keys(list(range(100)), 16, 32)) == 2  # only the first max_tokens count


def test_match_finds_the_replica_with_the_longest_prefix():
    index = PrefixIndex(block_size=4)
    system = list(range(100, 112))  # three blocks
    index.insert(system + [1, 2, 3, 4], "r1")
    index.insert(system[:4] + [7, 7, 7, 7], "r2")
    assert index.match(system + [9, 9, 9, 9], ["r1", "r2"]) == (["r1"], 12)
    # Both were sent the first block only.
    assert index.match(system[:4] + [5, 5, 5, 5], ["r1", "r2"]) == (["r1", "r2"], 4)
    # Only live replicas count.
    assert index.match(system + [9, 9, 9, 9], ["r2"]) == (["r2"], 4)
    assert index.match([0, 0, 0, 0], ["r1", "r2"]) == ([], 0)


def test_lru_eviction():
    index = PrefixIndex(block_size=2, max_blocks=4)
    index.insert([1, 2, 3, 4], "a")
    index.insert([5, 6, 7, 8, 9, 10], "a")  # 5 blocks in all: the oldest goes
    assert len(index) == 4
    assert index.match([1, 2, 3, 4], ["a"]) == ([], 0)
    assert index.match([5, 6, 7, 8, 9, 10], ["a"]) == (["a"], 6)
