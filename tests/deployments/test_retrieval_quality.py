"""Retrieval quality on the fixed corpus (tests/fixtures/retrieval, tests/retrieval_corpus.py):
30 paraphrased questions over ~100k tokens of the Python reference manual, cut by the
default static chunking (800 tokens, 400 overlap) and embedded as the product embeds
them (all-MiniLM-L6-v2, `Embedder.embed_passages`). The method measured is the one
file_search uses (deployments/retrieval/service.py, hybrid=True): vector similarity
fused with BM25 by reciprocal rank fusion. bench/retrieval_quality.py prints the whole
table (BM25 and vectors alone, other chunkings).

No Ray: the Embedder is a plain class here. Embedding the corpus is most of the time
(about a minute on two cores), done once for the module."""

import os

import pytest

from deployments.config import EmbeddingsConfig
from deployments.embeddings import Embedder
from tests import retrieval_corpus as rc

# Measured 0.800 (24 of 30) on this corpus. A one-line edit to each document's header,
# which shifts every chunk's boundaries by a few tokens, moved it between 0.800 and 0.833:
# several answers sit at rank 6. The floor leaves those two questions of slack, and sees
# a change to chunking, embedding or fusion that costs more.
HYBRID_RECALL_AT_5_FLOOR = 0.75
TARGET_RECALL_AT_5 = 0.9  # the issue's


@pytest.fixture(scope="module")
def measured():
    import torch

    threads = torch.get_num_threads()
    embedder = Embedder(EmbeddingsConfig())  # sets 1 thread, a replica's share
    torch.set_num_threads(os.cpu_count() or 1)  # the test's own speed: all cores
    try:
        docs = rc.documents()
        qs = rc.questions(docs)
        chunks = rc.chunk_corpus(embedder, docs)
        vectors = rc.embed_chunks(embedder, chunks)
        queries = [q.question for q in qs]
        vector = rc.vector_rankings(embedder, vectors, queries)
    finally:
        torch.set_num_threads(threads)
    lexical = rc.bm25_rankings(chunks, queries)
    rankings = {"bm25": lexical, "vectors": vector, "hybrid": rc.hybrid_rankings(vector, lexical)}
    figures = {name: rc.measure(r, chunks, qs) for name, r in rankings.items()}
    return docs, qs, chunks, rankings, figures


def test_the_corpus_is_the_size_the_measure_needs(measured):
    docs, qs, chunks, _, _ = measured
    assert len(chunks) >= 200
    assert len(qs) == 30
    # Every document asked about, none the bulk of the questions.
    per_doc = {name: sum(q.document == name for q in qs) for name in docs}
    assert min(per_doc.values()) >= 3, per_doc
    assert max(per_doc.values()) <= 5, per_doc


def test_hybrid_recall_at_5_holds_its_floor(measured):
    _, qs, chunks, rankings, figures = measured
    assert figures["hybrid"]["recall@5"] >= HYBRID_RECALL_AT_5_FLOOR, (
        figures,
        rc.misses(rankings["hybrid"], chunks, qs),
    )


def test_hybrid_finds_at_least_what_either_half_finds_alone(measured):
    # Why the product fuses: measured 0.800 at 5 and 0.933 at 10, against BM25's 0.733
    # and 0.800 and vectors' 0.733 and 0.833.
    figures = measured[4]
    for n in ("recall@5", "recall@10"):
        assert figures["hybrid"][n] >= max(figures["bm25"][n], figures["vectors"][n]), figures


@pytest.mark.xfail(
    strict=True,
    reason="the issue's 0.9 is not reached at 800/400 by any method measured "
    "(bench/retrieval_quality.py): hybrid 0.80-0.83, BM25 and vectors alone 0.70-0.73; "
    "hybrid reaches 0.93 at 10. When this passes, make it the floor.",
)
def test_hybrid_recall_at_5_reaches_the_issue_s_target(measured):
    assert measured[4]["hybrid"]["recall@5"] >= TARGET_RECALL_AT_5
