"""RoutingState (deployments/routing_state.py): what every ingress's router shares. The
actor's logic, as plain Python; through Ray and Serve in tests/serve/test_context_affinity.py."""

import asyncio

from deployments import routing_state
from deployments.routing_state import RoutingState, SharedRouting


def test_pins_and_prefixes_written_by_one_router_are_read_by_another():
    state = RoutingState()
    assert state.push("a", "M", pins=[("ctx", "r1")], prompts=[([11, 12, 13], "r2")]) == 0
    assert state.where("M", "ctx") == "r1" and state.where("other model", "ctx") is None
    assert state.match("M", [11, 12, 99], ["r1", "r2"]) == (["r2"], 2)
    assert state.match("M", [11, 12], ["r1"]) == ([], 0)  # only live replicas count
    assert state.push("b", "M") == 1  # a second writer: each now sees another


def test_the_first_claim_of_a_new_context_wins_while_its_replica_lives():
    state = RoutingState()
    assert state.claim("M", "ctx", "r1", ["r1", "r2"]) == "r1"
    assert state.claim("M", "ctx", "r2", ["r1", "r2"]) == "r1"
    assert state.claim("M", "ctx", "r2", ["r2"]) == "r2"  # r1 is gone: claimed anew
    assert state.where("M", "ctx") == "r2"


def test_writers_that_fell_silent_stop_counting(monkeypatch):
    state = RoutingState()
    clock = [100.0]
    monkeypatch.setattr(routing_state.time, "monotonic", lambda: clock[0])
    state.push("a", "M")
    clock[0] += routing_state.ACTIVE_S + 1
    assert state.push("b", "M") == 0


def test_without_the_actor_a_router_knows_only_itself():
    """No Ray here: every read is "unknown", nothing starts Ray, and the router stops
    waiting on a shared state that is not there."""
    shared = SharedRouting("app", "M", max_blocks=10)
    assert asyncio.run(shared.where("ctx")) is None
    assert asyncio.run(shared.claim("ctx", "r1", ["r1"])) == "r1"
    assert asyncio.run(shared.match([1, 2], ["r1"])) == ([], 0)
    shared.pinned("ctx", "r1")
    shared.sent([1, 2], "r1")
    assert shared.others is False


def test_a_rebalance_plan_evens_out_the_live_replicas_least_recently_used_first():
    state = RoutingState()
    pins = [(f"c{i}", "r1") for i in range(7)] + [("d0", "r2"), ("x", "dead")]
    state.push("a", "M", pins=pins)
    plan = state.plan("M", ["r1", "r2", "r3"])
    assert plan == [("c0", "r1", "r3"), ("c1", "r1", "r2"), ("c2", "r1", "r3"), ("c3", "r1", "r2")]
    assert state.plan("M", ["r1"]) == [] and state.plan("other", ["r1", "r2"]) == []
    for i in range(4):  # freed where they were: no longer counted
        state.forget("M", f"c{i}", "r1")
    state.forget("M", "d0", "r1")  # pinned elsewhere (made again there): kept
    assert state.where("M", "d0") == "r2"
    assert state.plan("M", ["r1", "r2", "r3"]) == [("c4", "r1", "r3")]


def test_a_context_parked_for_a_named_replica_is_pinned_there(monkeypatch):
    monkeypatch.setattr(routing_state.ray, "put", lambda data: data)  # no Ray here
    state = RoutingState()
    state.push("a", "M", pins=[("c", "r1"), ("d", "r1")])
    state.park("M", "c", b"slot", to="r2")
    state.park("M", "d", b"slot")  # drained: no replica named
    assert state.where("M", "c") == "r2" and state.where("M", "d") is None
    assert state.unpark("M", "c", "r2") == [b"slot"]


def test_a_parked_context_is_lent_until_its_restore_is_confirmed(monkeypatch):
    """A restore that fails, or a replica that never answers, does not lose the bytes."""
    monkeypatch.setattr(routing_state.ray, "put", lambda data: data)
    clock = [1000.0]
    monkeypatch.setattr(routing_state.time, "monotonic", lambda: clock[0])
    state = RoutingState()
    assert state.park("M", "c", b"slot", source="r1")
    assert state.unpark("M", "c", "r2") == [b"slot"] and state.where("M", "c") == "r2"
    assert state.unpark("M", "c", "r3") is None  # lent to r2 meanwhile
    state.returned("M", "c")  # r2's restore failed
    assert state.unpark("M", "c", "r3") == [b"slot"]
    clock[0] += routing_state.LENT_S + 1  # r3 never said: lent again
    assert state.unpark("M", "c", "r2") == [b"slot"]
    state.taken("M", "c")
    assert state.unpark("M", "c", "r3") is None and not state.parked


def test_a_context_made_again_elsewhere_is_not_parked_over(monkeypatch):
    monkeypatch.setattr(routing_state.ray, "put", lambda data: data)
    state = RoutingState()
    state.push("a", "M", pins=[("c", "r2")])  # made again on r2 while r1 drained
    assert not state.park("M", "c", b"old", source="r1")
    assert not state.parked and state.where("M", "c") == "r2"


def test_a_slow_answer_keeps_the_actor_handle(monkeypatch):
    """Only a dead actor is looked up again; a busy one is asked again next time."""

    class Never:
        def remote(self, *args):  # noqa: ANN002, ANN202
            return asyncio.get_running_loop().create_future()

    class Busy:
        where = Never()

    monkeypatch.setattr(routing_state, "TIMEOUT_S", 0.01)
    shared = SharedRouting("app", "M", max_blocks=10)
    busy = Busy()
    shared._actor = busy
    assert asyncio.run(shared.where("ctx")) is None
    assert shared._actor is busy
