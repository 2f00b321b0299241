"""Reciprocal rank fusion (Cormack, Clarke and Büttcher, SIGIR 2009): rankings from
different retrievers (vector similarity, BM25) merged by rank alone. Their scores are on
scales that cannot be compared (a cosine, an unbounded BM25 sum), their ranks can."""

from collections.abc import Hashable, Iterable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def fuse(rankings: Iterable[Iterable[K]], k: int = 60) -> list[K]:
    """Every key of `rankings` (each best first), best first by the sum over the rankings
    that hold it of 1 / (k + rank), rank counted from 1. k = 60 is the paper's: it damps
    the weight of a ranking's very top, so a key two retrievers both rank well beats one
    that only one of them ranks first. A key listed twice in one ranking counts at its
    best rank there. Equal sums keep the order in which keys were first seen, earlier
    rankings first, so the result is deterministic."""
    if k < 0:
        raise ValueError(f"k must be at least 0, not {k}")
    scores: dict[K, float] = {}
    for ranking in rankings:
        seen: set[K] = set()
        for rank, key in enumerate(ranking, start=1):
            if key in seen:
                continue
            seen.add(key)
            scores[key] = scores.get(key, 0.0) + 1.0 / (k + rank)
    # sorted() is stable: ties stay in the dict's insertion order (first seen).
    return sorted(scores, key=lambda key: -scores[key])
