"""A vector store's file limit holds against batches that race into it: the second
batch's transaction waits for the first's and counts its files (SQLite's write lock;
PostgreSQL's advisory lock, deployments/state/database.py `take_turns`)."""

import threading
import time

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.protocol.errors import ConflictError
from deployments.retrieval.stores import new_store, queue_files
from deployments.state.database import Database
from deployments.state.files import StoredFile, VectorStore, VectorStoreFile
from tests.postgres import postgres_server, unavailable

NO_POSTGRES = unavailable()


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param(
            "postgresql",
            marks=[
                pytest.mark.skipif(NO_POSTGRES is not None, reason=str(NO_POSTGRES)),
                pytest.mark.live,
            ],
        ),
    ]
)
def url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'app.sqlite3'}"
        return
    with postgres_server() as pg:
        yield pg


def race(url: str, files: int, first: list[str], second: list[str], limit: int):  # noqa: ANN201
    """A store and `files` files; `first` queued in a transaction that stays open while
    `second` is queued in another (which must wait for it, or be wrong), then commits.
    Returns what the second got ("queued" or its error) and the rows the store holds."""
    db = Database(url)
    try:
        with Session(db.engine) as s, s.begin():
            store_id = new_store(s, None, name="raced").id
            for i in range(files):
                s.add(
                    StoredFile(
                        id=f"file-{i}",
                        filename="f",
                        purpose="assistants",
                        bytes=1,
                        media_type="text/plain",
                    )
                )

        def queue(s: Session, ids: list[str]) -> None:
            store = s.scalar(select(VectorStore).filter_by(id=store_id))
            queue_files(s, store, [{"file_id": f} for f in ids], None, None, limit)

        outcome: dict[str, object] = {}

        def later() -> None:
            try:
                with Session(db.engine) as s, s.begin():
                    queue(s, second)
                outcome["second"] = "queued"
            except Exception as exc:  # noqa: BLE001  (what it got is the test's to judge)
                outcome["second"] = exc

        with Session(db.engine) as s, s.begin():
            queue(s, first)
            racer = threading.Thread(target=later)
            racer.start()
            time.sleep(0.5)  # the second reaches its reads while the first is open
        racer.join(timeout=10)
        with Session(db.engine) as s:
            held = s.scalar(select(func.count()).select_from(VectorStoreFile))
    finally:
        db.close()
    return outcome.get("second"), held


def test_a_batch_racing_another_into_a_store_cannot_pass_its_limit(url):
    # The limit was counted before the batch's rows were written: a second batch read
    # the count while the first was still writing, and both got in (6 files of 4).
    got, held = race(url, 6, ["file-0", "file-1", "file-2"], ["file-3", "file-4", "file-5"], 4)
    assert isinstance(got, ConflictError), got
    assert held == 3


def test_two_adds_of_one_file_racing_into_a_store_leave_one_row(url):
    # The store's row was written with the ORM, which writes nothing when the value is
    # the same (its last use in this same second): the second add read no row, waited
    # on the first's lock only at its insert, and failed on the unique key (a 500).
    got, held = race(url, 1, ["file-0"], ["file-0"], 10)
    assert got == "queued" and held == 1, got
