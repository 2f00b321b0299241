"""The Assistants database: one SQLAlchemy engine, its migrations, and the one way to run
a unit of work (`Database.work`: a session and a transaction, in a worker thread so that
the ingress's event loop never waits on I/O). Only the store (store.py) calls it.
"""

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, delete, event, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.orm import Session

from app.protocol.errors import InvalidRequestError, NotFoundError
from deployments.state.base import IdempotencyKey, now

if TYPE_CHECKING:
    from deployments.http.caller import Caller

logger = logging.getLogger("ray.serve")
T = TypeVar("T")
MIGRATIONS = Path(__file__).parent / "migrations"
PAGE_LIMIT = (1, 100)
MIGRATION_LOCK = 0x5E0A1  # pg_advisory_xact_lock's key for our migrations
KEYS_KEPT_S = 24 * 3600  # how long an Idempotency-Key is remembered


def _sqlite_module() -> Any:
    """pysqlite3 where it is installed: an SQLite that loads extensions (sqlite-vec), which
    the stdlib's may not (pyenv builds it without). None: the stdlib's."""
    try:
        import pysqlite3.dbapi2 as module  # type: ignore[import-not-found]
    except ImportError:
        return None
    return module


def _load_sqlite_vec(conn: Any) -> None:
    """sqlite-vec into this connection, where the driver and the package allow; the
    vector index asks `vec_version()` to know (deployments/retrieval/index.py)."""
    try:
        import sqlite_vec

        conn.enable_load_extension(True)
        sqlite_vec.load(conn)
        conn.enable_load_extension(False)
    except Exception as exc:  # noqa: BLE001  (no such package, or a driver without it)
        logger.debug("sqlite-vec not loaded: %s", exc)


def open_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        module = _sqlite_module()
        extra = {"module": module} if module is not None else {}
        # A writer waits at most 5 s for the file's lock: well inside a run's lease.
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 5}, **extra
        )

        @event.listens_for(engine, "connect")
        def _pragmas(conn: Any, _record: Any) -> None:
            # WAL: readers never wait for the writer; several processes may share the file.
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()
            _load_sqlite_vec(conn)

        return engine
    return create_engine(url, pool_pre_ping=True)


def migrate(engine: Engine) -> None:
    """`alembic upgrade head` on this engine. Ingress replicas start together: on
    PostgreSQL they take turns under an advisory lock; on SQLite (or anywhere the lock is
    missing) the loser of a race finds the schema made and tries again."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    for attempt in range(5):
        try:
            with engine.begin() as conn:
                if conn.dialect.name == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK})
                config.attributes["connection"] = conn
                command.upgrade(config, "head")
            return
        except (OperationalError, ProgrammingError, IntegrityError) as exc:
            if attempt == 4:
                raise
            logger.warning("assistants database: migration raced (%s); again", exc.orig)
            time.sleep(0.2 * (attempt + 1))


class Database:
    def __init__(self, url: str) -> None:
        self.engine = open_engine(url)
        migrate(self.engine)

    async def work(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(session, *args)` in one transaction, committed when it returns."""
        return await asyncio.to_thread(self._work, fn, *args)

    def _work(self, fn: Callable[..., T], *args: Any) -> T:
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            return fn(session, *args)

    def close(self) -> None:
        self.engine.dispose()


def take_turns(s: Session, name: str) -> None:
    """Transactions that name the same thing run one after another from here to their
    end: PostgreSQL's advisory lock for this transaction. SQLite needs none: its first
    write takes the file's one write lock, so a check written after a write (insert,
    then count) sees every transaction committed before it."""
    if s.get_bind().dialect.name == "postgresql":
        digest = hashlib.sha256(name.encode()).digest()
        key = int.from_bytes(digest[:8], "big", signed=True)
        s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})


def visible(model: type, viewer: "Caller | None") -> list:
    """The condition on `model`'s rows that `viewer` may see (state/assistants.py,
    OWNERS): its own rows; every row for an admin, a server without keys, or None (the
    server itself)."""
    if viewer is None or viewer.admin or not viewer.keyed:
        return []
    return [model.owner == viewer.key_id]  # type: ignore[attr-defined]


def find(
    session: Session, model: type[T], object_id: str, viewer: "Caller | None" = None, **where: Any
) -> T:
    """The row with this public id (and these column values) that `viewer` may see; 404
    in OpenAI's words (also for another key's row: its id tells nothing)."""
    stmt = select(model).filter_by(id=object_id, **where).where(*visible(model, viewer))
    row = session.scalar(stmt)
    if row is None:
        name = model.__tablename__.rstrip("s").replace("_", " ")  # type: ignore[attr-defined]
        raise NotFoundError(f"No {name} found with id '{object_id}'.", param=None)
    return row


def page(
    session: Session,
    model: type,
    limit: int = 20,
    order: str = "desc",
    after: str | None = None,
    before: str | None = None,
    viewer: "Caller | None" = None,
    **where: Any,
) -> dict:
    """OpenAI's cursor pagination over the rows `viewer` may see, ordered by `seq`:
    `after` and `before` name the row the page starts after or ends before (in the
    list's order)."""
    if not PAGE_LIMIT[0] <= limit <= PAGE_LIMIT[1]:
        raise InvalidRequestError("limit must be between 1 and 100", param="limit")
    if order not in ("asc", "desc"):
        raise InvalidRequestError("order must be 'asc' or 'desc'", param="order")
    ascending = order == "asc"
    mine = visible(model, viewer)
    stmt = select(model).filter_by(**where).where(*mine)
    for cursor, later in ((after, ascending), (before, not ascending)):
        if cursor is not None:
            seq = session.scalar(select(model.seq).filter_by(id=cursor, **where).where(*mine))
            if seq is None:
                raise InvalidRequestError(f"no such cursor '{cursor}'", param="cursor")
            stmt = stmt.where(model.seq > seq if later else model.seq < seq)
    # A `before` page is the `limit` rows just before the cursor: read backwards.
    backwards = before is not None and after is None
    forward = ascending != backwards
    stmt = stmt.order_by(model.seq.asc() if forward else model.seq.desc()).limit(limit + 1)
    rows = list(session.scalars(stmt))
    has_more = len(rows) > limit
    rows = rows[:limit]
    if backwards:
        rows.reverse()
    data = [r.as_api() for r in rows]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


async def once(
    db: Database, key: str | None, scope: str, model: type, create: Callable
) -> tuple[dict, bool]:
    """`create(session)` once per (scope, Idempotency-Key): a retry gets the first object
    as it is now, also when the two race (the unique key decides); and whether it was
    made now. Keys are forgotten after a day. A unique index that a concurrent request
    won (the same key, or one active run per thread) is retried once: then `create`
    sees the winner."""

    def work(s: Session) -> tuple[dict, bool]:
        if key is None:
            return create(s), True
        seen = s.scalar(select(IdempotencyKey).filter_by(scope=scope, key=key))
        if seen is not None:
            return find(s, model, seen.object_id).as_api(), False
        made = create(s)
        s.add(IdempotencyKey(scope=scope, key=key, object_id=made["id"]))
        s.execute(delete(IdempotencyKey).where(IdempotencyKey.created_at < now() - KEYS_KEPT_S))
        s.flush()
        return made, True

    try:
        return await db.work(work)
    except IntegrityError:
        return await db.work(work)
