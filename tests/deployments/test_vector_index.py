"""The vector indexes agree: sqlite-vec's vec0 table, pgvector's column and the exact
matrix scan find the same nearest chunks with the same scores, before and after chunks
are deleted, and the exact index never answers from a matrix older than its store."""

import numpy as np
import pytest
from sqlalchemy import delete, update
from sqlalchemy.orm import Session

from deployments.retrieval.index import (
    ExactIndex,
    PgVectorIndex,
    SqliteVecIndex,
    open_index,
    pack,
)
from deployments.state.database import Database
from deployments.state.files import Chunk, VectorStore
from tests.postgres import postgres_server, unavailable

NO_POSTGRES = unavailable()


@pytest.fixture
def db(tmp_path):
    database = Database(f"sqlite:///{tmp_path / 'x.sqlite3'}")
    yield database
    database.close()


def _fill(db: Database, index, n: int, dim: int = 16) -> np.ndarray:
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    with Session(db.engine) as s, s.begin():
        for store in ("vs_a", "vs_b"):
            s.add(VectorStore(id=store, meta={}, last_active_at=0, version=0))
        made = [
            Chunk(
                store_id="vs_a" if i % 2 else "vs_b",
                file_id=f"file-{i % 5}",
                position=i,
                text=f"chunk {i}",
                tokens=1,
                embedding=pack(v.tolist()),
            )
            for i, v in enumerate(vectors)
        ]
        s.add_all(made)
        s.flush()
        for store in ("vs_a", "vs_b"):
            index.add(s, store, [c for c in made if c.store_id == store])
    return vectors


def _search(db: Database, index, stores, query, k):  # noqa: ANN001, ANN202
    with Session(db.engine) as s, s.begin():
        return index.search(s, stores, query, k)


def test_sqlite_vec_and_exact_agree(db):
    assert isinstance(open_index(db.engine), SqliteVecIndex)  # this SQLite loads sqlite-vec
    vec, exact = SqliteVecIndex(), ExactIndex()
    vectors = _fill(db, vec, 300)
    rng = np.random.default_rng(1)
    for _ in range(5):
        q = rng.standard_normal(16).astype(np.float32)
        q /= np.linalg.norm(q)
        for stores in (["vs_a"], ["vs_a", "vs_b"], ["vs_none"]):
            a = _search(db, vec, stores, q.tolist(), 7)
            b = _search(db, exact, stores, q.tolist(), 7)
            assert [s for s, _ in a] == [s for s, _ in b]
            assert np.allclose([x for _, x in a], [x for _, x in b], atol=1e-5)
    # The best of all is the true argmax over both stores.
    q = vectors[43]  # in vs_a (odd)
    assert _search(db, vec, ["vs_a", "vs_b"], q.tolist(), 1)[0][0] == 44  # seq = index + 1

    with Session(db.engine) as s, s.begin():  # delete vs_b's chunks from both
        seqs = [c.seq for c in s.query(Chunk).filter_by(store_id="vs_b")]
        vec.delete(s, "vs_b", seqs)
        s.execute(delete(Chunk).where(Chunk.store_id == "vs_b"))
        s.execute(update(VectorStore).where(VectorStore.id == "vs_b").values(version=1))
    assert _search(db, vec, ["vs_b"], q.tolist(), 5) == []
    assert _search(db, exact, ["vs_b"], q.tolist(), 5) == []  # a new version: re-read
    assert _search(db, exact, ["vs_a"], q.tolist(), 1)[0][0] == 44


def test_the_exact_index_keeps_its_matrices_within_a_byte_budget(db):
    # Bounded by count alone, 64 stores of 100,000 chunks would have held ~10 GB.
    exact = ExactIndex()
    exact.CACHED_BYTES = 150 * 16 * 4  # one store's matrix (150 chunks x 16) at a time
    _fill(db, exact, 300)
    q = [1.0] + [0.0] * 15
    for stores in (["vs_a"], ["vs_b"], ["vs_a", "vs_b"]):
        assert _search(db, exact, stores, q, 3)
        assert sum(m.nbytes for _, m in exact._cache.values()) <= exact.CACHED_BYTES
    assert len(exact._cache) == 1
    exact.CACHED_BYTES = 100  # smaller than any store: nothing is kept, answers stay right
    assert _search(db, exact, ["vs_a"], q, 3) == _search(db, ExactIndex(), ["vs_a"], q, 3)
    assert not exact._cache


@pytest.mark.live  # starts a PostgreSQL server
@pytest.mark.skipif(NO_POSTGRES is not None, reason=str(NO_POSTGRES))
def test_pgvector_and_exact_agree_on_postgresql():
    """Where the server has pgvector (built here; Debian 12 does not package it), its
    index and the exact scan find the same chunks; where it has not, open_index falls
    back to the exact scan."""
    with postgres_server() as url:
        db = Database(url)
        try:
            index = open_index(db.engine)
            if not isinstance(index, PgVectorIndex):
                assert isinstance(index, ExactIndex)  # the fallback: nothing more to compare
                return
            exact = ExactIndex()
            vectors = _fill(db, index, 200)
            for i in (3, 50, 101):
                q = vectors[i].tolist()
                for stores in (["vs_a"], ["vs_a", "vs_b"]):
                    a = _search(db, index, stores, q, 6)
                    b = _search(db, exact, stores, q, 6)
                    assert [s for s, _ in a] == [s for s, _ in b]
                    assert np.allclose([x for _, x in a], [x for _, x in b], atol=1e-5)
            with Session(db.engine) as s, s.begin():
                seqs = [c.seq for c in s.query(Chunk).filter_by(store_id="vs_a")]
                index.delete(s, "vs_a", seqs)
            assert _search(db, index, ["vs_a"], vectors[3].tolist(), 3) == []
        finally:
            db.close()
