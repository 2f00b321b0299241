"""Retrieval quality on the fixed corpus (tests/fixtures/retrieval, tests/retrieval_corpus.py):
30 paraphrased questions over ~100k tokens of the Python reference manual, cut by the
default static chunking (800 tokens, 400 overlap) and embedded as the product embeds
them (all-MiniLM-L6-v2, `Embedder.embed_passages`). The method measured is the one
file_search uses on SQLite (deployments/retrieval/service.py, hybrid=True): the first 20
by vector similarity fused with the first 20 of FTS5's BM25 (its tokenizer, its query
words) by reciprocal rank fusion; rank_bm25's plain BM25 is reported beside it as the
baseline. bench/retrieval_quality.py prints the whole table (other methods, other
chunkings).

No Ray: the Embedder is a plain class here. Embedding the corpus is most of the time
(about a minute on two cores), done once for the module."""

import os

import pytest

from deployments.config import EmbeddingsConfig
from deployments.embeddings import Embedder
from tests import retrieval_corpus as rc

# Measured 0.800 (24 of 30) on this corpus. A one-line edit to each document's header,
# which shifts every chunk's boundaries by a few tokens, moved the fusion between 0.800
# and 0.833: several answers sit at rank 6. The floor leaves those questions of slack,
# and sees a change to chunking, embedding, the lexical half or fusion that costs more.
HYBRID_RECALL_AT_5_FLOOR = 0.75
TARGET_RECALL_AT_5 = 0.9  # the issue's
PRODUCT_DEPTH = 20  # each half's candidates for 5 results (service.py: CANDIDATES x k)


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
    fts = rc.fts_rankings(chunks, queries)
    rankings = {
        "bm25": rc.bm25_rankings(chunks, queries),
        "fts": fts,
        "vectors": vector,
        "product": rc.hybrid_rankings(vector, fts, depth=PRODUCT_DEPTH),
    }
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
    assert figures["product"]["recall@5"] >= HYBRID_RECALL_AT_5_FLOOR, (
        figures,
        rc.misses(rankings["product"], chunks, qs),
    )


def test_hybrid_finds_at_least_what_either_half_finds_alone(measured):
    # Why the product fuses: measured 0.800 at 5 and 0.900 at 10, against FTS5's 0.600
    # and 0.800 and vectors' 0.733 and 0.833 (the plain BM25 baseline: 0.733, 0.800).
    figures = measured[4]
    for n in ("recall@5", "recall@10"):
        assert figures["product"][n] >= max(figures["fts"][n], figures["vectors"][n]), figures


@pytest.mark.xfail(
    strict=True,
    reason="the issue's 0.9 is not reached at 800/400 by file_search (0.800), nor "
    "robustly by any variant measured (docs/benchmarks.md: 0.80-0.93, within a question "
    "or two of each other). When this passes, make it the floor.",
)
def test_hybrid_recall_at_5_reaches_the_issue_s_target(measured):
    assert measured[4]["product"]["recall@5"] >= TARGET_RECALL_AT_5
