"""A replica's adapters (deployments/replica_adapters.py), over an engine whose errors
come as the engine's process sends them (RemoteError): a load's bad file is the
operator's 400 with its reason; the same failure under a request is the server's 503,
naming no path."""

import asyncio

import pytest

from app.protocol.errors import RemoteError, UnavailableError
from app.protocol.lora_ids import adapter_id, shown
from deployments.replica_adapters import ReplicaAdapters


class Engine:
    def __init__(self, error: RemoteError | None) -> None:
        self.error, self.loaded = error, []

    async def set_lora(self, name: str, path: str | None) -> None:
        if self.error is not None:
            raise self.error
        self.loaded.append((name, path))


def test_a_request_s_unreadable_adapter_is_a_503_that_names_no_path():
    key = adapter_id("live", "/srv/models/live", 7)
    gone = RemoteError(400, "invalid_request_error", f"{key}: /srv/models/live: gone", "lora")
    adapters = ReplicaAdapters(Engine(gone), max_loras=4)  # not in Serve: no multiplexing
    with pytest.raises(RemoteError) as refused:
        asyncio.run(adapters.load(key, "/srv/models/live"))
    assert refused.value.status_code == 400 and "gone" in refused.value.message
    with pytest.raises(UnavailableError) as unavailable:
        asyncio.run(adapters.hold(key, "/srv/models/live"))
    assert unavailable.value.status_code == 503
    assert "/srv" not in unavailable.value.message and "'live'" in unavailable.value.message
    dead = RemoteError(503, "engine_error", "the engine died", None)
    with pytest.raises(RemoteError):  # not the adapter's: as it came
        asyncio.run(ReplicaAdapters(Engine(dead), 4).hold(key, "/srv/models/live"))


def test_each_load_of_a_name_is_its_own_id_and_shown_by_its_name():
    ids = {adapter_id("a", "/m/a"), adapter_id("a", "/m/b"), adapter_id("a", "/m/a", 2)}
    assert len(ids) == 3 and {shown(i) for i in ids} == {"a"}
    assert shown("plain") == "plain" and shown("x@y") == "x@y"
    engine = Engine(None)
    asyncio.run(ReplicaAdapters(engine, 4).hold(adapter_id("a", "/m/a"), "/m/a"))
    assert engine.loaded == [(adapter_id("a", "/m/a"), "/m/a")]
