"""The Responses store is bounded in bytes as well as in count (a request may be
megabytes), and a conversation too long to continue is refused before it is rendered."""

import pytest

import deployments.response_store as response_store
from app.protocol.errors import InvalidRequestError, NotFoundError
from deployments.response_store import ResponseStore, StoredResponse


def _turn(i: int, text: str) -> StoredResponse:
    message = {"role": "user", "content": text}
    previous = f"resp_{i - 1}" if i else None
    return StoredResponse(f"resp_{i}", "m", "resp_0", previous, [message], [message])


def test_store_evicts_by_bytes_least_recently_used_first():
    store = ResponseStore(max_responses=100, max_bytes=10_000)
    for i in range(10):
        store.put(_turn(i, "x" * 2_000))
    kept = [i for i in range(10) if _present(store, f"resp_{i}")]
    assert kept == [8, 9]  # about 4.1 kB each: two fit in 10 kB, the newest
    with pytest.raises(NotFoundError, match="no longer stored"):
        store.conversation("resp_9")


def test_a_conversation_too_long_to_continue_is_a_400(monkeypatch):
    monkeypatch.setattr(response_store, "MAX_CONVERSATION_BYTES", 9_000)
    store = ResponseStore()
    for i in range(5):
        store.put(_turn(i, "y" * 2_000))
    store.conversation("resp_1")  # two turns: under the bound
    with pytest.raises(InvalidRequestError, match="too long to continue"):
        store.conversation("resp_4")


def _present(store: ResponseStore, response_id: str) -> bool:
    try:
        store.get(response_id)
    except NotFoundError:
        return False
    return True
