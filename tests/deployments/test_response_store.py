"""Stored Responses live in the app's database: a store on another ingress replica (here,
another store on the same database) continues the chain; a deleted turn breaks the
chains through it with a 404 that says so; a conversation too long to continue is
refused before it is rendered."""

import asyncio

import pytest

import deployments.api.responses.store as response_store
from app.protocol.errors import InvalidRequestError, NotFoundError
from deployments.api.responses.store import Entry, ResponseStore
from deployments.state.database import Database


def _turn(i: int, text: str) -> Entry:
    message = {"role": "user", "content": text}
    previous = f"resp_{i - 1}" if i else None
    return Entry(f"resp_{i}", "m", "resp_0", previous, [message], [message], {"id": f"resp_{i}"})


@pytest.fixture
def url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'app.sqlite3'}"


def test_a_chain_stored_by_one_replica_is_continued_by_another(url):
    async def go():  # noqa: ANN202
        one, other = ResponseStore(Database(url)), ResponseStore(Database(url))
        for i in range(3):
            await (one if i % 2 else other).put(_turn(i, f"turn {i}"))
        last, history = await other.conversation("resp_2")
        body = (await one.get("resp_1")).body
        deleted = await one.delete("resp_1")
        with pytest.raises(NotFoundError, match="no longer stored"):
            await other.conversation("resp_2")
        with pytest.raises(NotFoundError, match="not found"):
            await other.get("resp_1")
        one.close(), other.close()
        return last, history, body, deleted

    last, history, body, deleted = asyncio.run(go())
    assert (last.id, last.chain, last.previous_id) == ("resp_2", "resp_0", "resp_1")
    assert [m["content"] for m in history] == [f"turn {i}" for i in range(3)]
    assert body == {"id": "resp_1"} and deleted.id == "resp_1"


def test_a_conversation_too_long_to_continue_is_a_400(monkeypatch, url):
    monkeypatch.setattr(response_store, "MAX_CONVERSATION_BYTES", 9_000)

    async def go():  # noqa: ANN202
        store = ResponseStore(Database(url))
        for i in range(5):
            await store.put(_turn(i, "y" * 2_000))
        await store.conversation("resp_1")  # two turns: under the bound
        with pytest.raises(InvalidRequestError, match="too long to continue"):
            await store.conversation("resp_4")
        store.close()

    asyncio.run(go())


def test_responses_older_than_30_days_go_and_a_failed_write_is_a_503(monkeypatch, url):
    from sqlalchemy.exc import OperationalError

    from app.protocol.errors import ShoalError

    async def go():  # noqa: ANN202
        store = ResponseStore(Database(url))
        await store.put(_turn(0, "old"))
        monkeypatch.setattr(response_store, "now", lambda: 10**10)  # 300 years on
        await store.put(_turn(1, "new"))
        with pytest.raises(NotFoundError):
            await store.get("resp_0")

        async def broken(*_args):  # noqa: ANN202
            raise OperationalError("INSERT", {}, Exception("database is locked"))

        monkeypatch.setattr(store.db, "work", broken)
        with pytest.raises(ShoalError) as failed:
            await store.put(_turn(2, "lost"))
        return failed.value

    failed = asyncio.run(go())
    assert failed.status_code == 503 and "could not be stored" in failed.message


def test_two_replicas_deleting_one_response_at_once_one_is_told_it_is_gone(url):
    """Both replicas may find the row; only the one whose DELETE removed it answers with
    it, the other a 404 (before, both said deleted)."""

    async def go():  # noqa: ANN202
        one, other = ResponseStore(Database(url)), ResponseStore(Database(url))
        outcomes = []
        for i in range(10):
            await one.put(_turn(i, f"turn {i}"))
            outcomes.append(
                await asyncio.gather(
                    one.delete(f"resp_{i}"), other.delete(f"resp_{i}"), return_exceptions=True
                )
            )
        one.close(), other.close()
        return outcomes

    for pair in asyncio.run(go()):
        assert sorted(type(r).__name__ for r in pair) == ["Entry", "NotFoundError"], pair
