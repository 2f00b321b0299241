"""The vector index over chunks (deployments/state/files.py, `Chunk`): nearest chunks of
some vector stores to a query vector, by cosine similarity of unit vectors.

Three kinds, chosen by the database (`open_index`):
- `SqliteVecIndex`: sqlite-vec's `vec0` table beside the chunks, one row per chunk (its
  rowid the chunk's `seq`), partitioned by store, so a search reads one store's vectors
  inside SQLite. Written in the same transaction as the chunks.
- `PgVectorIndex`: pgvector's `vector` column in a table beside the chunks, on a
  PostgreSQL server that has the extension; likewise written with the chunks.
- `ExactIndex`: every other database (PostgreSQL without pgvector, an SQLite that cannot
  load extensions). The chunks' own float32 bytes, read once per store and version into a
  matrix that this process keeps (a store's `version` grows with each change to its
  chunks, so a stale matrix is never used), then one matrix product a search.
All are exact (no approximate neighbours): at the sizes one ingress holds, a scan of
float32 vectors is milliseconds, and exact results need no recall to be measured twice.
"""

import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
from sqlalchemy import select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from deployments.state.files import Chunk, VectorStore

logger = logging.getLogger("ray.serve")
Hit = tuple[int, float]  # (the chunk's seq, its cosine similarity to the query)


def pack(vector: list[float]) -> bytes:
    return np.asarray(vector, dtype=np.float32).tobytes()


class ExactIndex:
    kind = "exact"
    # Matrices kept (each a store's chunks x dimension float32), bounded in bytes: 64 small
    # stores, or a few of 100,000 chunks (150 MB each at MiniLM's 384). A store larger
    # than the whole budget is read each time, not kept.
    CACHED_STORES = 64
    CACHED_BYTES = 512 << 20

    def __init__(self) -> None:
        self._cache: OrderedDict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, session: Session, store_id: str, chunks: list[Chunk]) -> None:
        """Nothing beyond the chunks' rows: their `embedding` is what this index reads."""

    def delete(self, session: Session, store_id: str, seqs: list[int]) -> None:
        """Nothing: the rows' deletion and the store's new version are enough."""

    def search(
        self, session: Session, store_ids: list[str], query: list[float], k: int
    ) -> list[Hit]:
        q = np.asarray(query, dtype=np.float32)
        hits: list[Hit] = []
        for store_id in store_ids:
            seqs, matrix = self._matrix(session, store_id)
            if not len(seqs):
                continue
            scores = matrix @ q
            top = np.argsort(-scores, kind="stable")[:k]
            hits += [(int(seqs[i]), float(scores[i])) for i in top]
        return sorted(hits, key=lambda h: -h[1])[:k]

    def _matrix(self, session: Session, store_id: str) -> tuple[np.ndarray, np.ndarray]:
        version = session.scalar(select(VectorStore.version).filter_by(id=store_id)) or 0
        key = (store_id, version)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        rows = session.execute(
            select(Chunk.seq, Chunk.embedding).filter_by(store_id=store_id).order_by(Chunk.seq)
        ).all()
        seqs = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        matrix = (
            np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), -1)
            if rows
            else np.zeros((0, 0), dtype=np.float32)
        )
        with self._lock:
            for old in [k for k in self._cache if k[0] == store_id]:
                del self._cache[old]  # an older version of this store: never read again
            if matrix.nbytes <= self.CACHED_BYTES:
                self._cache[key] = (seqs, matrix)
            held = sum(m.nbytes for _, m in self._cache.values())
            while len(self._cache) > self.CACHED_STORES or held > self.CACHED_BYTES:
                held -= self._cache.popitem(last=False)[1][1].nbytes
        return seqs, matrix


class SqliteVecIndex:
    """sqlite-vec's vec0 table, one per dimension (another embedding model, another
    table), made when a first chunk of that dimension is written."""

    kind = "sqlite-vec"

    @staticmethod
    def table(dim: int) -> str:
        return f"chunk_vectors_{dim}"

    def add(self, session: Session, store_id: str, chunks: list[Chunk]) -> None:
        if not chunks:
            return
        dim = len(chunks[0].embedding) // 4
        self._ensure(session, dim)
        session.execute(
            text(
                f"INSERT INTO {self.table(dim)}(rowid, embedding, store_id) "
                "VALUES (:seq, :embedding, :store_id)"
            ),
            [{"seq": c.seq, "embedding": c.embedding, "store_id": store_id} for c in chunks],
        )

    def delete(self, session: Session, store_id: str, seqs: list[int]) -> None:
        for dim in self._dims(session):
            for start in range(0, len(seqs), 500):
                part = seqs[start : start + 500]
                marks = ",".join(str(int(s)) for s in part)
                session.execute(text(f"DELETE FROM {self.table(dim)} WHERE rowid IN ({marks})"))

    def search(
        self, session: Session, store_ids: list[str], query: list[float], k: int
    ) -> list[Hit]:
        dim = len(query)
        if dim not in self._dims(session):
            return []
        hits: list[Hit] = []
        for store_id in store_ids:  # a partition key matches one value per query
            rows = session.execute(
                text(
                    f"SELECT rowid, distance FROM {self.table(dim)} "
                    "WHERE embedding MATCH :q AND k = :k AND store_id = :store_id"
                ),
                {"q": pack(query), "k": k, "store_id": store_id},
            ).all()
            hits += [(int(seq), 1.0 - float(distance)) for seq, distance in rows]
        return sorted(hits, key=lambda h: -h[1])[:k]

    def _dims(self, session: Session) -> set[int]:
        names = session.scalars(
            text("SELECT name FROM sqlite_master WHERE name LIKE 'chunk\\_vectors\\_%' ESCAPE '\\'")
        )
        return {int(n.rsplit("_", 1)[1]) for n in names if n.rsplit("_", 1)[1].isdigit()}

    def _ensure(self, session: Session, dim: int) -> None:
        # Every time, not once per process: a table made in a transaction that then
        # rolled back is gone, whatever this process remembers.
        session.execute(
            text(
                f"CREATE VIRTUAL TABLE IF NOT EXISTS {self.table(dim)} USING vec0("
                f"embedding float[{dim}] distance_metric=cosine, store_id text partition key)"
            )
        )


class PgVectorIndex:
    """pgvector's `vector` column in a table beside the chunks, one per dimension, read
    by an exact scan per store (`ORDER BY embedding <=> q`, no approximate index: a store
    filter over an HNSW index can return fewer than k)."""

    kind = "pgvector"

    @staticmethod
    def table(dim: int) -> str:
        return f"chunk_vectors_{dim}"

    @staticmethod
    def literal(vector: Any) -> str:
        return "[" + ",".join(f"{float(x):.9g}" for x in vector) + "]"

    def add(self, session: Session, store_id: str, chunks: list[Chunk]) -> None:
        if not chunks:
            return
        dim = len(chunks[0].embedding) // 4
        self._ensure(session, dim)
        session.execute(
            text(
                f"INSERT INTO {self.table(dim)} (seq, store_id, embedding) "
                "VALUES (:seq, :store_id, CAST(:embedding AS vector))"
            ),
            [
                {"seq": c.seq, "store_id": store_id, "embedding": self.literal(unpack(c.embedding))}
                for c in chunks
            ],
        )

    def delete(self, session: Session, store_id: str, seqs: list[int]) -> None:
        for dim in self._dims(session):
            session.execute(
                text(f"DELETE FROM {self.table(dim)} WHERE seq = ANY(:seqs)"), {"seqs": seqs}
            )

    def search(
        self, session: Session, store_ids: list[str], query: list[float], k: int
    ) -> list[Hit]:
        dim = len(query)
        if dim not in self._dims(session):
            return []
        rows = session.execute(
            text(
                "SELECT seq, 1 - (embedding <=> CAST(:q AS vector)) AS score "
                f"FROM {self.table(dim)} WHERE store_id = ANY(:stores) "
                "ORDER BY embedding <=> CAST(:q AS vector) LIMIT :k"
            ),
            {"q": self.literal(query), "stores": list(store_ids), "k": k},
        ).all()
        return [(int(seq), float(score)) for seq, score in rows]

    def _dims(self, session: Session) -> set[int]:
        names = session.scalars(
            text(r"SELECT tablename FROM pg_tables WHERE tablename LIKE 'chunk\_vectors\_%'")
        )
        return {int(n.rsplit("_", 1)[1]) for n in names if n.rsplit("_", 1)[1].isdigit()}

    def _ensure(self, session: Session, dim: int) -> None:
        table = self.table(dim)  # every time: see SqliteVecIndex._ensure
        session.execute(
            text(
                f"CREATE TABLE IF NOT EXISTS {table} (seq integer PRIMARY KEY, "
                f"store_id varchar(64) NOT NULL, embedding vector({dim}) NOT NULL)"
            )
        )
        session.execute(text(f"CREATE INDEX IF NOT EXISTS ix_{table}_store ON {table} (store_id)"))


Index = ExactIndex | SqliteVecIndex | PgVectorIndex


def _pgvector(engine: Engine) -> bool:
    """Whether this PostgreSQL server has pgvector (made available in this database)."""
    try:
        with engine.begin() as conn:
            if conn.execute(text("SELECT 1 FROM pg_extension WHERE extname = 'vector'")).first():
                return True
            conn.execute(text("CREATE EXTENSION IF NOT EXISTS vector"))
        return True
    except Exception as exc:  # noqa: BLE001 (not installed on the server, or no privilege)
        logger.warning("vector index: pgvector is not available (%s); exact search", exc)
        return False


def open_index(engine: Engine) -> Index:
    """sqlite-vec where the database is SQLite and the extension loaded into it
    (deployments/state/database.py); pgvector where the database is a PostgreSQL server
    that has it; else the exact index."""
    if engine.dialect.name == "postgresql" and _pgvector(engine):
        logger.info("vector index: pgvector")
        return PgVectorIndex()
    if engine.dialect.name == "sqlite":
        try:
            with engine.connect() as conn:
                version = conn.execute(text("SELECT vec_version()")).scalar()
            logger.info("vector index: sqlite-vec %s", version)
            return SqliteVecIndex()
        except Exception as exc:  # noqa: BLE001 (no such function: not loaded)
            logger.warning("vector index: sqlite-vec is not available (%s); exact search", exc)
    return ExactIndex()


def unpack(blob: Any) -> np.ndarray:
    return np.frombuffer(bytes(blob), dtype=np.float32)
