"""Retrieval on this machine: ingestion throughput, recall on the Python-docs corpus, and
search latency at 100,000 chunks per vector index, all through deployments/retrieval.

1. Ingestion: the corpus (tests/fixtures/retrieval) written under a fresh data_dir, each
   file named by its id, with the rows an upload and a vector store file make (in_progress,
   never leased); the real Ingestor indexes them into a fresh SQLite database. MB/s =
   corpus bytes / wall seconds from its start to the last file completed, split into the
   Embedder's chunking and embedding (timed around its calls).
2. Recall@1/5/10 through `Retrieval.search` on that store: vectors only, hybrid, and BM25
   alone (the lexical index); a hit is a result chunk holding the question's answer.
3. Latency at --chunks chunks: the ingested chunks repeated, each copy's vector with a
   little gaussian noise (re-normalised), written as the ingestor writes them (embedding
   100k chunks here would take hours). Per index (sqlite-vec; ExactIndex on the same
   SQLite rows; ExactIndex and tsvector on PostgreSQL where its binaries are): the vector
   index alone, the lexical index alone, and the whole hybrid `Retrieval.search` (query
   embedding included; also timed alone), p50/p99 over --queries queries cycling the 30
   questions; each index's first query apart (ExactIndex builds its matrix then).
The last line printed is one JSON object with every figure.
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import func, select, update  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

from deployments.config import EmbeddingsConfig  # noqa: E402
from deployments.embeddings import Embedder  # noqa: E402
from deployments.files_config import FilesConfig  # noqa: E402
from deployments.retrieval.extract import media_type_of  # noqa: E402
from deployments.retrieval.index import ExactIndex, Index  # noqa: E402
from deployments.retrieval.service import Retrieval  # noqa: E402
from deployments.state.files import Chunk, StoredFile, VectorStore, VectorStoreFile  # noqa: E402
from tests import postgres  # noqa: E402
from tests.local_app import LocalHandle  # noqa: E402
from tests.retrieval_corpus import Question, documents, questions  # noqa: E402

K = 10  # results a search asks for: file_search's max_num_results default
CHUNKING = {"max_chunk_size_tokens": 800, "chunk_overlap_tokens": 400}  # OpenAI's default
CORPUS_STORE, BIG_STORE = "vs_corpus", "vs_big"
# Per component: a copy's cosine to its original is ~1/sqrt(1 + 384 * 0.01^2) = 0.98, so
# copies are near their original (searches rank like the real corpus) but never tie.
NOISE = 0.01
BATCH = 2000  # chunks a transaction writes while the big store is built
CUTOFFS = (1, 5, 10)


class Timed:
    """The Embedder with the seconds spent in each of its methods summed, so that the
    ingestion's wall time splits into chunking and embedding."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder, self.spent = embedder, {}

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.embedder, name)

        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - start

        return timed


def file_id(name: str) -> str:
    return "file-" + Path(name).stem


def add_store(s: Session, store: str, docs: dict[str, str], status: str) -> None:
    """A vector store holding every document, with each file's row where it is missing
    (the big store reuses the ingested files: results need their names)."""
    s.add(VectorStore(id=store, name=store))
    for name, body in docs.items():
        raw, fid = body.encode(), file_id(name)
        if s.scalar(select(StoredFile.seq).filter_by(id=fid)) is None:
            kind = media_type_of(name, raw, complete=True)  # as an upload decides it
            file = {"filename": name, "purpose": "assistants", "bytes": len(raw)}
            s.add(StoredFile(id=fid, media_type=kind, **file))
        vsf = {"status": status, "leased_at": 0.0, "chunking": CHUNKING}
        s.add(VectorStoreFile(store_id=store, file_id=fid, **vsf))


def statuses(s: Session, store: str) -> dict[str, int]:
    rows = s.execute(
        select(VectorStoreFile.status, func.count())
        .filter_by(store_id=store)
        .group_by(VectorStoreFile.status)
    ).all()
    return dict(rows)


async def ingest(r: Retrieval, timed: Timed, docs: dict[str, str]) -> dict:
    r.data_dir.mkdir(parents=True, exist_ok=True)
    for name, body in docs.items():
        r.path_of(file_id(name)).write_bytes(body.encode())
    await r.db.work(add_store, CORPUS_STORE, docs, "in_progress")
    size = sum(len(b.encode()) for b in docs.values())
    start = time.perf_counter()
    r.start()
    while (await r.db.work(statuses, CORPUS_STORE)).get("in_progress"):
        await asyncio.sleep(0.05)
    wall = time.perf_counter() - start
    await r.ingestor.stop()
    done = await r.db.work(statuses, CORPUS_STORE)
    if done != {"completed": len(docs)}:
        raise RuntimeError(f"ingestion ended with {done}")
    chunks = await r.db.work(
        lambda s: s.scalar(select(func.count()).select_from(Chunk).filter_by(store_id=CORPUS_STORE))
    )
    out = {
        "corpus_bytes": size,
        "ingest_s": round(wall, 2),
        "ingest_mb_s": round(size / 1e6 / wall, 4),
        "ingest_chunks": chunks,
        "ingest_chunks_s": round(chunks / wall, 2),
        "ingest_chunking_s": round(timed.spent.get("chunk", 0.0), 2),
        "ingest_embedding_s": round(timed.spent.get("embed_passages", 0.0), 2),
    }
    print(
        f"ingestion: {size / 1e6:.3f} MB, {len(docs)} files -> {chunks} chunks in {wall:.1f} s"
        f" = {out['ingest_mb_s']} MB/s, {out['ingest_chunks_s']} chunks/s"
        f" (chunking {out['ingest_chunking_s']} s, embedding {out['ingest_embedding_s']} s)",
        flush=True,
    )
    return out


def first_hits(lists: list[list[str]], qs: list[Question]) -> list[int | None]:
    """The rank (from 1) of each question's first hit among its result texts."""
    return [
        next((rank for rank, t in enumerate(texts, 1) if q.hit(t)), None)
        for texts, q in zip(lists, qs, strict=True)
    ]


async def recall(r: Retrieval, store: str, qs: list[Question], tag: str = "") -> dict:
    texts = await r.db.work(
        lambda s: dict(s.execute(select(Chunk.seq, Chunk.text).filter_by(store_id=store)).all())
    )
    results: dict[str, list[list[str]]] = {"vector": [], "hybrid": [], "bm25": []}
    for q in qs:
        for hybrid, key in ((False, "vector"), (True, "hybrid")):
            found = await r.search([store], q.question, K, hybrid=hybrid)
            results[key].append([f.text for f in found])
        seqs = await r.db.work(r.lexical.search, [store], q.question, K)
        results["bm25"].append([texts[seq] for seq in seqs])
    out = {}
    for key, lists in results.items():
        ranks = first_hits(lists, qs)
        for n in CUTOFFS:
            hits = sum(rank is not None and rank <= n for rank in ranks)
            out[f"recall_at_{n}_{key}{tag}"] = round(hits / len(qs), 4)
    shown = {key: [out[f"recall_at_{n}_{key}{tag}"] for n in CUTOFFS] for key in results}
    print(f"recall{tag or '_sqlite'} @1/@5/@10 ({len(qs)} questions): {shown}", flush=True)
    return out


def base_chunks(s: Session, store: str) -> list[tuple]:
    rows = s.execute(
        select(Chunk.file_id, Chunk.text, Chunk.tokens, Chunk.embedding)
        .filter_by(store_id=store)
        .order_by(Chunk.seq)
    ).all()
    return [tuple(row) for row in rows]


def write_batch(
    s: Session, r: Retrieval, store: str, rows: list[tuple], vectors: np.ndarray, at: int
) -> None:
    """As the ingestor's commit writes chunks: the rows, then both indexes, one transaction."""
    made = [
        Chunk(
            store_id=store,
            file_id=row[0],
            position=at + j,
            text=row[1],
            tokens=row[2],
            embedding=vectors[j].tobytes(),
        )
        for j, row in enumerate(rows)
    ]
    s.add_all(made)
    s.flush()  # their seqs, which the indexes are keyed by
    r.index.add(s, store, made)
    r.lexical.add(s, store, made)


async def populate(r: Retrieval, store: str, base: list[tuple], n: int, noise: float) -> float:
    rng = np.random.default_rng(0)
    vecs = np.stack([np.frombuffer(b[3], dtype=np.float32) for b in base])
    start = time.perf_counter()
    for at in range(0, n, BATCH):
        picks = np.arange(at, min(at + BATCH, n)) % len(base)
        v = vecs[picks] + rng.normal(0.0, noise, (len(picks), vecs.shape[1])).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        await r.db.work(write_batch, r, store, [base[i] for i in picks], v, at)
    # A new version, as the ingestor's commit makes: no ExactIndex matrix is stale.
    await r.db.work(
        lambda s: s.execute(
            update(VectorStore).filter_by(id=store).values(version=VectorStore.version + 1)
        )
    )
    return time.perf_counter() - start


def pct(ms: list[float]) -> tuple[float, float]:
    p50, p99 = np.percentile(ms, [50, 99])
    return round(float(p50), 2), round(float(p99), 2)


async def series(calls: Any, n: int, budget_s: float) -> list[float]:
    """Milliseconds of each awaited `calls(i)`, i < n; past `budget_s` (and 2 queries) it
    stops: a PostgreSQL lexical query at 100k chunks takes minutes here, 200 would be hours."""
    ms: list[float] = []
    began = time.perf_counter()
    while len(ms) < n and (len(ms) < 2 or time.perf_counter() - began < budget_s):
        start = time.perf_counter()
        await calls(len(ms))
        ms.append((time.perf_counter() - start) * 1000)
    return ms


async def latency(
    r: Retrieval, index: Index, name: str, qs: list[Question], vectors: list, args: Any
) -> dict:
    """Vector-only, lexical-only and hybrid latency of the big store with `index`."""
    store, n, budget = [BIG_STORE], args.queries, args.budget_s
    first = (await series(lambda i: r.db.work(index.search, store, vectors[0], K), 1, 0))[0]
    out = {f"search_first_ms_{name}": round(first, 2)}
    line = f"{name}: first query {first:.1f} ms; p50/p99 ms (queries):"
    kept, r.index = r.index, index  # Retrieval.search reads self.index
    try:
        for kind, call in (
            ("vector", lambda i: r.db.work(index.search, store, vectors[i % len(vectors)], K)),
            # As many as a hybrid search asks of its lexical half (service.py's CANDIDATES).
            (
                "lexical",
                lambda i: r.db.work(r.lexical.search, store, qs[i % len(qs)].question, K * 4),
            ),
            ("hybrid", lambda i: r.search(store, qs[i % len(qs)].question, K)),
        ):
            ms = await series(call, n, budget)
            p50, p99 = pct(ms)
            out[f"search_p50_ms_{kind}_{name}"], out[f"search_p99_ms_{kind}_{name}"] = p50, p99
            out[f"search_n_{kind}_{name}"] = len(ms)
            line += f" {kind} {p50}/{p99} ({len(ms)});"
    finally:
        r.index = kept
    print(line, flush=True)
    return out


async def big_store(r: Retrieval, base: list[tuple], docs: dict[str, str], n: int, tag: str):
    await r.db.work(add_store, BIG_STORE, docs, "completed")
    took = await populate(r, BIG_STORE, base, n, NOISE)
    print(f"{tag}: wrote {n:,} chunks in {took:.1f} s ({n / took:,.0f}/s)", flush=True)
    return {f"populate_s_{tag}": round(took, 2)}


async def run(args: argparse.Namespace) -> dict:
    figures: dict = {"chunks": args.chunks, "queries": args.queries, "k": K}
    figures["loadavg_start"] = round(os.getloadavg()[0], 2)  # other work on these 2 cores
    embedder = Embedder(EmbeddingsConfig())
    timed = Timed(embedder)
    handle = LocalHandle(timed)
    docs = documents()
    qs = questions(docs)
    with tempfile.TemporaryDirectory(prefix="shoal-retrieval-") as tmp:
        config = FilesConfig(data_dir=f"{tmp}/files")
        r = Retrieval(f"sqlite:///{tmp}/x.sqlite3", config, handle)
        try:
            figures.update(await ingest(r, timed, docs))
            figures.update(await recall(r, CORPUS_STORE, qs))
            base = await r.db.work(base_chunks, CORPUS_STORE)
            vectors, embed_ms = [], []
            for i in range(args.queries):  # the query embedding alone, as search calls it
                start = time.perf_counter()
                vector = embedder.embed([qs[i % len(qs)].question], True)[0][0]
                embed_ms.append((time.perf_counter() - start) * 1000)
                if i < len(qs):
                    vectors.append(vector)
            figures["query_embed_p50_ms"], figures["query_embed_p99_ms"] = pct(embed_ms)
            print(f"query embedding p50/p99: {pct(embed_ms)} ms", flush=True)
            figures.update(await big_store(r, base, docs, args.chunks, "sqlite"))
            name = "sqlite_vec" if r.index.kind == "sqlite-vec" else "sqlite_default"
            figures.update(await latency(r, r.index, name, qs, vectors, args))
            figures.update(await latency(r, ExactIndex(), "exact_sqlite", qs, vectors, args))
        finally:
            await r.stop()
        reason = "--skip-postgres" if args.skip_postgres else postgres.unavailable()
        if reason is not None:
            print(f"postgresql: skipped ({reason})", flush=True)
            return figures
        with postgres.postgres_server() as url:
            p = Retrieval(url, config, handle)
            try:
                # The ingested chunks as they are (no noise): recall with tsvector's ranking.
                await p.db.work(add_store, CORPUS_STORE, docs, "completed")
                await populate(p, CORPUS_STORE, base, len(base), 0.0)
                figures.update(await recall(p, CORPUS_STORE, qs, "_pg"))
                figures.update(await big_store(p, base, docs, args.chunks, "pg"))
                figures.update(await latency(p, p.index, "exact_pg", qs, vectors, args))
            finally:
                await p.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--skip-postgres", action="store_true")
    parser.add_argument("--budget-s", type=float, default=240.0, help="most seconds a series")
    args = parser.parse_args()
    start = time.perf_counter()
    figures = asyncio.run(run(args))
    figures["wall_s"] = round(time.perf_counter() - start, 1)
    figures["loadavg_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
