"""deployments/retrieval/fusion.py: reciprocal rank fusion, on rankings small enough to
check by hand."""

import pytest

from deployments.retrieval.fusion import fuse


def test_a_key_both_rankings_hold_beats_one_only_one_ranks_first():
    # "b": 1/62 + 1/62 = 0.0323; "a": 1/61 = 0.0164; "c": 1/61 = 0.0164.
    assert fuse([["a", "b"], ["c", "b"]]) == ["b", "a", "c"]


def test_k_sets_how_much_a_ranking_s_top_outweighs_agreement():
    rankings = [["a", "x", "b"], ["y", "z", "b"]]
    # k=0: "a" and "y" score 1/1, "b" 1/3 + 1/3: one retriever's first beats agreement.
    assert fuse(rankings, k=0) == ["a", "y", "b", "x", "z"]
    # k=60: "b" 2/63 = 0.0317 beats "a" and "y" 1/61 = 0.0164: agreement wins.
    assert fuse(rankings) == ["b", "a", "y", "x", "z"]


def test_ties_keep_first_seen_order_earlier_rankings_first():
    assert fuse([["a", "b"], ["b", "a"]]) == ["a", "b"]
    assert fuse([["b", "a"], ["a", "b"]]) == ["b", "a"]


def test_one_ranking_comes_back_as_it_is():
    assert fuse([[3, 1, 2]]) == [3, 1, 2]


def test_a_key_repeated_in_one_ranking_counts_once_at_its_best_rank():
    # "b" 1/63 + 1/61 = 0.0323 beats "a" 1/61; counted twice, "a" would have 1/61 + 1/62.
    assert fuse([["a", "a", "b"], ["b", "c"]]) == ["b", "a", "c"]


def test_empty_and_disjoint_rankings():
    assert fuse([]) == []
    assert fuse([[], []]) == []
    assert fuse([[1, 2], [], [3]]) == [1, 3, 2]


def test_rankings_may_be_any_iterables_of_hashable_keys():
    assert fuse((iter([(1, "a"), (2, "b")]), ((2, "b"),))) == [(2, "b"), (1, "a")]


def test_a_negative_k_is_refused():
    with pytest.raises(ValueError):
        fuse([["a"]], k=-1)
