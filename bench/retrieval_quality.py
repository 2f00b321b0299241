"""How well file_search finds the passage that answers a question: the fixed corpus of
tests/fixtures/retrieval (Python reference manual text, ~100k tokens in 8 documents) and
its 30 paraphrased questions, each answered by a known passage. For each chunking, the
corpus is cut by the Embedder's static chunking, embedded as the product embeds it
(all-MiniLM-L6-v2, `embed_passages`), and each question's chunks are ranked by:

- bm25: rank_bm25's BM25Okapi over lowercased word tokens (the plain baseline);
- fts: file_search's own lexical half on SQLite (FTS5, Porter, stop words dropped);
- vectors: cosine similarity to the question's embedding;
- product: what file_search does for 5 results: reciprocal rank fusion (k=60) of the
  first 20 of vectors and of fts (deployments/retrieval/service.py: CANDIDATES x k);
- hybrid: the same fusion of the whole vectors and bm25 rankings;
- vectors-bestwin, hybrid-bestwin: a chunk scored by its most similar window (254
  tokens) instead of the mean of its windows that `embed_passages` stores: what a long
  chunk loses to the mean (an alternative, not what the product does).

Printed: recall@1/5/10 and MRR per method, the chunk count and the time to embed the
corpus, per chunking; the last line is a JSON object of the same figures.

    .venv/bin/python bench/retrieval_quality.py [--chunkings 800/400,400/100,200/50]
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.config import EmbeddingsConfig  # noqa: E402
from deployments.embeddings import Embedder  # noqa: E402
from tests import retrieval_corpus as rc  # noqa: E402

PRODUCT_DEPTH = 20  # service.py's CANDIDATES (4) x k (5): each half's pool for recall@5


def one_chunking(embedder: Embedder, docs, qs, max_tokens: int, overlap: int, show: bool):
    chunks = rc.chunk_corpus(embedder, docs, max_tokens, overlap)
    started = time.perf_counter()
    windows, owner = rc.embed_windows(embedder, chunks)
    embed_s = time.perf_counter() - started
    vectors = rc.mean(windows, owner, len(chunks))
    # The product's own call on a few chunks: the mean above must be what it returns.
    drift = float(abs(rc.embed_chunks(embedder, chunks[:8]) - vectors[:8]).max())
    assert drift < 1e-4, f"mean of windows differs from embed_passages by {drift}"
    queries = rc.query_vectors(embedder, [q.question for q in qs])
    lexical = rc.bm25_rankings(chunks, [q.question for q in qs])
    fts = rc.fts_rankings(chunks, [q.question for q in qs])
    vector = rc.ranked(queries @ vectors.T)
    best = rc.ranked(rc.best_window(queries, windows, owner, len(chunks)))
    rankings = {
        "bm25": lexical,
        "fts": fts,
        "vectors": vector,
        "product": rc.hybrid_rankings(vector, fts, depth=PRODUCT_DEPTH),
        "hybrid": rc.hybrid_rankings(vector, lexical),
        "vectors-bestwin": best,
        "hybrid-bestwin": rc.hybrid_rankings(best, lexical),
    }
    figures = {name: rc.measure(r, chunks, qs) for name, r in rankings.items()}
    label = f"{max_tokens}/{overlap}"
    print(f"\nchunking {label}: {len(chunks)} chunks, {sum(len(c.ids) for c in chunks)} tokens,")
    print(
        f"embedded in {embed_s:.1f} s ({len(chunks) / embed_s:.1f} chunks/s, {len(owner)} windows)"
    )
    print(f"{'method':<14}{'recall@1':>10}{'recall@5':>10}{'recall@10':>11}{'MRR':>8}")
    for name, f in figures.items():
        print(
            f"{name:<14}{f['recall@1']:>10.3f}{f['recall@5']:>10.3f}"
            f"{f['recall@10']:>11.3f}{f['mrr']:>8.3f}"
        )
    if show:
        for name, r in rankings.items():
            for line in rc.misses(r, chunks, qs):
                print(f"  {name} misses@5: {line}")
    return {"chunks": len(chunks), "embed_s": round(embed_s, 2), **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--chunkings",
        default="800/400,400/100,200/50",
        help="max_tokens/overlap pairs, comma-separated; 800/400 is OpenAI's default",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads (a replica uses 1; the bench measures quality, not speed)",
    )
    parser.add_argument("--misses", action="store_true", help="list questions missed at 5")
    args = parser.parse_args()

    import torch

    embedder = Embedder(EmbeddingsConfig())
    torch.set_num_threads(args.threads)  # after the Embedder, which sets 1
    docs = rc.documents()
    qs = rc.questions(docs)
    print(f"{len(docs)} documents, {len(qs)} questions, torch threads {args.threads}")
    results = {}
    for pair in args.chunkings.split(","):
        max_tokens, overlap = (int(x) for x in pair.split("/"))
        results[pair] = one_chunking(embedder, docs, qs, max_tokens, overlap, args.misses)
    print(json.dumps({"documents": len(docs), "questions": len(qs), "chunkings": results}))


if __name__ == "__main__":
    main()
