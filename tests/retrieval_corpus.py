"""The retrieval corpus (tests/fixtures/retrieval: Markdown documents and 30 questions
whose answers lie in known chunks) and its measure, shared by the fast test
(tests/deployments/test_retrieval_quality.py) and the bench (bench/retrieval_quality.py).

A question's answer is a short exact substring of its document: a retrieved chunk is a
hit if it holds that substring (or one of the question's `also`, other passages that
answer it as well), so the measure does not depend on where a chunker cuts."""

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deployments.retrieval.fusion import fuse
from deployments.retrieval.lexical import TOKENIZER, fts_match, terms

CORPUS = Path(__file__).resolve().parent / "fixtures" / "retrieval"
WORD = re.compile(r"\w+")
CUTOFFS = (1, 5, 10)
PASSAGES_PER_CALL = 16  # embed_passages pads all of a call's windows into one tensor


@dataclass(frozen=True)
class Question:
    question: str
    document: str
    answer: str
    also: tuple[str, ...] = ()
    occurrences: int = 1  # of `answer` in the corpus, each one checked to answer

    def hit(self, text: str) -> bool:
        return any(a in text for a in (self.answer, *self.also))


@dataclass(frozen=True)
class Chunk:
    document: str
    text: str
    ids: list[int]


def documents() -> dict[str, str]:
    """File name -> text, for every document of the corpus (its README is not one)."""
    return {
        p.name: p.read_text(encoding="utf-8")
        for p in sorted(CORPUS.glob("*.md"))
        if p.name != "README.md"
    }


def questions(docs: dict[str, str] | None = None) -> list[Question]:
    """The questions, each checked against the corpus: its answer in its document, and
    found as often as it says. An answer that also sat, unnoticed, in a passage that does
    not answer would make a wrong chunk count as a hit."""
    docs = documents() if docs is None else docs
    raw = json.loads((CORPUS / "questions.json").read_text(encoding="utf-8"))
    out = []
    for row in raw:
        q = Question(**{**row, "also": tuple(row.get("also", ()))})
        found = sum(text.count(q.answer) for text in docs.values())
        if q.answer not in docs.get(q.document, "") or found != q.occurrences:
            raise ValueError(f"{q.question!r}: its answer is found {found} times in the corpus")
        if not all(any(a in text for text in docs.values()) for a in q.also):
            raise ValueError(f"{q.question!r}: one of its `also` is not in the corpus")
        out.append(q)
    return out


def chunk_corpus(
    embedder: Any, docs: dict[str, str], max_tokens: int = 800, overlap: int = 400
) -> list[Chunk]:
    """Every document cut by the Embedder's static chunking (800/400: OpenAI's default)."""
    return [
        Chunk(name, text, ids)
        for name, body in docs.items()
        for text, ids in embedder.chunk(body, max_tokens, overlap)
    ]


def embed_chunks(
    embedder: Any, chunks: list[Chunk], per_call: int = PASSAGES_PER_CALL
) -> np.ndarray:
    """One unit vector a chunk (rows), as the product embeds them (`embed_passages`: the
    mean of the chunk's windows), a few chunks a call: all 247 default chunks in one call
    would pad ~800 windows into one attention batch, gigabytes for no speed."""
    rows: list[list[float]] = []
    for start in range(0, len(chunks), per_call):
        batch = chunks[start : start + per_call]
        rows += embedder.embed_passages([c.ids for c in batch])
    return np.asarray(rows, dtype=np.float32)


def embed_windows(embedder: Any, chunks: list[Chunk]) -> tuple[np.ndarray, np.ndarray]:
    """The unit vector of every window `embed_passages` cuts a chunk into (rows), and the
    chunk each belongs to: from these one pass gives both the product's pooling (`mean`)
    and the best-window score (`best_window`) the bench compares it with."""
    windows, owner = [], []
    for i, c in enumerate(chunks):
        for start in range(0, max(len(c.ids), 1), embedder.window):
            windows.append(c.ids[start : start + embedder.window])
            owner.append(i)
    # A window is at most one model window: embed_passages embeds it as it is. A call
    # takes as many windows as PASSAGES_PER_CALL chunks of 800 tokens would.
    vectors = embed_chunks(embedder, [Chunk("", "", w) for w in windows], 4 * PASSAGES_PER_CALL)
    return vectors, np.asarray(owner)


def mean(windows: np.ndarray, owner: np.ndarray, n: int) -> np.ndarray:
    """Each chunk's windows averaged and normalised: what `embed_passages` returns."""
    out = np.zeros((n, windows.shape[1]), dtype=np.float32)
    np.add.at(out, owner, windows)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def query_vectors(embedder: Any, queries: list[str]) -> np.ndarray:
    """One unit vector a query, each embedded as the product embeds a search's query."""
    return np.asarray([embedder.embed([q], True)[0][0] for q in queries], dtype=np.float32)


def best_window(queries: np.ndarray, windows: np.ndarray, owner: np.ndarray, n: int):
    """Each query's similarity to each chunk as its most similar window's: a long chunk
    is not diluted by the windows that do not answer."""
    out = np.full((len(queries), n), -np.inf, dtype=np.float32)
    np.maximum.at(out.T, owner, (queries @ windows.T).T)
    return out


def ranked(scores: np.ndarray) -> list[list[int]]:
    """Each row's columns, highest score first (ties: the earlier chunk first)."""
    return [np.argsort(-row, kind="stable").tolist() for row in scores]


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def bm25_rankings(chunks: list[Chunk], queries: list[str]) -> list[list[int]]:
    """Each query's chunks, best first, by BM25 (rank_bm25's Okapi, its defaults) over
    lowercased word tokens: the plain baseline, no stemming, no stop words."""
    from rank_bm25 import BM25Okapi

    bm25 = BM25Okapi([words(c.text) for c in chunks])
    return [np.argsort(-bm25.get_scores(words(q)), kind="stable").tolist() for q in queries]


def fts_rankings(chunks: list[Chunk], queries: list[str]) -> list[list[int]]:
    """Each query's chunks, best first, as file_search's lexical half ranks them on
    SQLite (deployments/retrieval/lexical.py): FTS5 with its tokenizer, the query's words
    less stop words OR-ed, ordered by `bm25()`; the chunks no word matched follow in
    corpus order."""
    import sqlite3

    db = sqlite3.connect(":memory:")
    try:
        db.execute(f"CREATE VIRTUAL TABLE t USING fts5(text, tokenize='{TOKENIZER}')")
        db.executemany(
            "INSERT INTO t(rowid, text) VALUES (?, ?)", enumerate(c.text for c in chunks)
        )
        out = []
        for q in queries:
            words = terms(q)
            found = (
                [
                    row[0]
                    for row in db.execute(
                        "SELECT rowid FROM t WHERE t MATCH ? ORDER BY bm25(t)", (fts_match(words),)
                    )
                ]
                if words
                else []
            )
            seen = set(found)
            out.append(found + [i for i in range(len(chunks)) if i not in seen])
        return out
    finally:
        db.close()


def vector_rankings(embedder: Any, vectors: np.ndarray, queries: list[str]) -> list[list[int]]:
    """Each query's chunks, best first, by cosine similarity (unit vectors: a dot product)."""
    return ranked(query_vectors(embedder, queries) @ vectors.T)


def hybrid_rankings(
    vector: list[list[int]], lexical: list[list[int]], depth: int | None = None, k: int = 60
) -> list[list[int]]:
    """Each query's two rankings fused (reciprocal rank fusion), vectors first (ties go
    to them). `depth`: only each ranking's first `depth` chunks are fused, as the product
    does (deployments/retrieval/service.py takes CANDIDATES x k from each half)."""
    return [fuse([v[:depth], w[:depth]], k=k) for v, w in zip(vector, lexical, strict=True)]


def first_hits(
    rankings: list[list[int]], chunks: list[Chunk], qs: list[Question]
) -> list[int | None]:
    """The rank (from 1) of each question's first hit in its ranking; None: no hit."""
    out: list[int | None] = []
    for ranking, q in zip(rankings, qs, strict=True):
        out.append(next((r for r, i in enumerate(ranking, 1) if q.hit(chunks[i].text)), None))
    return out


def measure(rankings: list[list[int]], chunks: list[Chunk], qs: list[Question]) -> dict[str, float]:
    """recall@1/5/10 (the share of questions with a hit among the first n chunks) and the
    mean reciprocal rank of the first hit (0 for a question with none)."""
    ranks = first_hits(rankings, chunks, qs)
    out = {f"recall@{n}": sum(r is not None and r <= n for r in ranks) / len(qs) for n in CUTOFFS}
    out["mrr"] = sum(1 / r for r in ranks if r is not None) / len(qs)
    return {key: round(value, 4) for key, value in out.items()}


def misses(
    rankings: list[list[int]], chunks: list[Chunk], qs: list[Question], n: int = 5
) -> list[str]:
    """The questions with no hit among the first `n`, and where their first hit is."""
    ranks = first_hits(rankings, chunks, qs)
    return [
        f"{q.question} (first hit: {r})"
        for q, r in zip(qs, ranks, strict=True)
        if r is None or r > n
    ]
