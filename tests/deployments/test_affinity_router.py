"""The router's decisions, over replica ids and queue lengths (no Ray started). Live
routing through Serve is covered by tests/serve/test_context_affinity.py."""

import asyncio
import random
from collections import Counter

import pytest

from app.protocol.messages import ContextAction, ContextOp, EngineRequest, context_op
from app.protocol.sampling import SamplingParams
from deployments.affinity_router import (
    balanced_holders,
    context_home,
    least_loaded,
    prompt_of,
    two_choices,
)
from deployments.context_pins import ContextPins

LIVE = {"r1", "r2", "r3"}


def never() -> str:
    raise AssertionError("no new home should be chosen")


def test_pins_keep_at_most_capacity_least_recently_used_first():
    pins = ContextPins(capacity=2)
    pins.pin("a", "r1")
    pins.pin("b", "r1")
    pins.touch("a")  # b is now the least recently used
    pins.pin("c", "r2")
    assert dict(pins.holder) == {"a": "r1", "c": "r2"}
    assert pins.held == {"r1": {"a"}, "r2": {"c"}}


def test_pins_go_with_their_replica():
    pins = ContextPins()
    pins.pin("c1", "r1")
    pins.pin("c2", "r1")
    pins.pin("c3", "r2")
    pins.pin("c2", "r2")  # created anew elsewhere: the new holder wins
    pins.drop_replica("r1")
    assert pins.holder == {"c2": "r2", "c3": "r2"}
    pins.pin("c4", "r3")
    pins.retain({"r3"})  # the replica set changed: r2 is gone
    assert pins.holder == {"c4": "r3"} and set(pins.held) == {"r3"}


def test_a_new_context_is_pinned_before_its_call_is_sent():
    pins = ContextPins()
    op = ContextOp("c", ContextAction.FILL)
    assert context_home(op, pins, LIVE, lambda: "r2") == "r2"
    assert pins.holder == {"c": "r2"}
    # A concurrent call for the same new context, routed before the first was sent,
    # follows the pin, whatever the usual choice would have been.
    assert context_home(ContextOp("c", ContextAction.GENERATE), pins, LIVE, never) == "r2"
    assert context_home(ContextOp("c", ContextAction.READ), pins, LIVE, never) == "r2"


def test_a_child_goes_to_its_parent_and_is_pinned_there():
    pins = ContextPins()
    pins.pin("parent", "r3")
    child = ContextOp("child", ContextAction.FILL, parent_context_id="parent")
    assert context_home(child, pins, LIVE, never) == "r3"
    assert pins.holder["child"] == "r3"
    # Once the child has a home of its own, that is where it goes.
    pins.pin("parent", "r1")
    assert context_home(child, pins, LIVE, never) == "r3"


@pytest.mark.parametrize("action", [ContextAction.READ, ContextAction.FREE, ContextAction.SAVE])
def test_calls_that_cannot_create_only_follow_a_pin(action: ContextAction):
    pins = ContextPins()
    assert context_home(ContextOp("c", action), pins, LIVE, never) is None
    assert not pins.holder  # a lookup or a free never pins
    pins.pin("c", "r1")
    assert context_home(ContextOp("c", action), pins, LIVE, never) == "r1"
    assert context_home(ContextOp("c", action), pins, {"r2", "r3"}, never) is None


def test_a_context_whose_holder_is_gone_is_created_anew_elsewhere():
    pins = ContextPins()
    pins.pin("c", "gone")
    restore = ContextOp("c", ContextAction.RESTORE)
    assert context_home(restore, pins, LIVE, lambda: "r1") == "r1"
    assert pins.holder == {"c": "r1"}


def test_two_choices_samples_distinct_pairs_uniformly():
    rng = random.Random(0)
    assert two_choices([], rng) == []
    assert two_choices(["a"], rng) == ["a"]
    assert sorted(two_choices(["a", "b"], rng)) == ["a", "b"]
    pairs = Counter(tuple(two_choices(["a", "b", "c"], rng)) for _ in range(6000))
    assert len(pairs) == 6 and all(a != b for a, b in pairs)  # every ordered pair
    assert min(pairs.values()) > 800  # ~1000 each


def test_least_loaded_takes_the_shorter_queue_first_of_equals():
    assert least_loaded(["a", "b"], {"a": 3, "b": 1}) == "b"
    assert least_loaded(["b", "a"], {"a": 2, "b": 2}) == "b"


def test_prefix_holders_must_be_within_max_imbalance_of_the_least_loaded():
    load = {"r1": 9, "r2": 4, "r3": 1}
    assert balanced_holders(["r1", "r2"], load, max_imbalance=3) == ["r2"]
    assert balanced_holders(["r1", "r2"], load, max_imbalance=8) == ["r1", "r2"]
    assert balanced_holders(["r1"], load, max_imbalance=0) == []


def test_the_router_reads_typed_objects_whatever_the_method():
    params = SamplingParams()
    plain = EngineRequest("q1", [1, 2, 3], params)
    op = ContextOp("c", ContextAction.GENERATE)
    in_context = EngineRequest("q2", [4], params, context=op)
    assert prompt_of((plain,)) == [1, 2, 3]
    assert prompt_of((in_context,)) is None  # its tokens extend a context: no prefix
    assert prompt_of((op, "file.bin")) is None
    assert context_op((in_context,)) == op
    assert context_op(("file.bin", op)) == op  # any position
    assert context_op((plain,)) is None and context_op(()) is None


def test_routers_of_one_deployment_in_a_process_share_their_maps():
    def router(name: str):  # noqa: ANN202
        return _router(name, routing={"max_imbalance": 3}, block_size=8)

    a, b, other = router("ModelServer:a"), router("ModelServer:a"), router("ModelServer:b")
    assert a.routing.max_imbalance == 3 and a.prefixes.block_size == 8
    assert a.pins is b.pins and a.prefixes is b.prefixes
    assert a.pins is not other.pins  # context ids may repeat across models


def _router(name: str, app: str = "test-affinity", **state):  # noqa: ANN003, ANN202
    # The real router class, constructed as Serve constructs it (no Ray started).
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from deployments.affinity_router import AffinityRouter

    r = AffinityRouter(
        deployment_id=DeploymentID(name=name, app_name=app),
        handle_source=DeploymentHandleSource.REPLICA,
        self_node_id="node",
        prefer_local_node_routing=False,
        prefer_local_az_routing=False,
        self_availability_zone=None,
        use_replica_queue_len_cache=True,
    )
    r.initialize_state(**state)
    return r


class Replica:
    """What the router asks of a departed replica: whether it still answers."""

    def __init__(self, alive: bool = True) -> None:
        self.alive = alive

    async def get_queue_len(self, *, deadline_s: float) -> int:
        if not self.alive:
            raise RuntimeError("actor died")
        return 0


class Shared:
    """The RoutingState's `where`, scripted: the pin changes after `moves_after` reads."""

    def __init__(self, pin: str | None, then: str | None, moves_after: int) -> None:
        self.pin, self.then, self.left, self.others = pin, then, moves_after, False

    async def where(self, context: str) -> str | None:
        self.left -= 1
        return self.pin if self.left >= 0 else self.then


def test_a_call_for_a_draining_replicas_context_waits_until_it_is_parked():
    r = _router("ModelServer:drain", move_wait_s=5.0)
    r.shared = Shared("old", None, moves_after=3)  # parked on the 4th read: pin gone
    r.departed["old"] = (Replica(), __import__("time").monotonic())
    op = ContextOp("c", ContextAction.GENERATE)
    assert asyncio.run(r._learn_pins(op, {"new"})) is False
    assert r.shared.left < 0  # it waited for the park, not the first answer

    r.shared = Shared("old", "new", moves_after=2)  # an operator's move: pinned on
    assert asyncio.run(r._learn_pins(op, {"new"})) is True
    assert r.pins.holder["c"] == "new"


def test_a_dead_or_long_gone_replica_is_not_waited_for():
    import time

    r = _router("ModelServer:dead", move_wait_s=5.0)
    r.shared = Shared("old", "old", moves_after=1000)
    r.departed["old"] = (Replica(alive=False), time.monotonic())
    started = time.monotonic()
    assert asyncio.run(r._learn_pins(ContextOp("c", ContextAction.READ), {"new"})) is False
    assert "old" not in r.departed and time.monotonic() - started < 1.0

    r.departed["old"] = (Replica(), time.monotonic() - 10.0)  # left past move_wait_s
    assert asyncio.run(r._await_move("c", "old")) == "old"


def test_with_other_ingresses_the_shared_pin_wins_over_a_stale_local_one():
    r = _router("ModelServer:moved")
    r.pins.pin("c", "r1")
    r.shared = Shared("r2", "r2", moves_after=1)
    op = ContextOp("c", ContextAction.GENERATE)
    assert asyncio.run(r._learn_pins(op, {"r1", "r2"})) is True
    assert r.pins.holder["c"] == "r1"  # one ingress: its own pins are the truth
    r.shared.others = True
    assert asyncio.run(r._learn_pins(op, {"r1", "r2"})) is True
    assert r.pins.holder["c"] == "r2"  # moved by an operator through another ingress


class Held:
    """A replica as the router sees it: its id and the adapters it holds."""

    def __init__(self, unique_id: str, adapters: tuple[str, ...] = ()) -> None:
        from ray.serve._private.common import DeploymentID, ReplicaID

        deployment = DeploymentID(name="ModelServer:lora", app_name="test-affinity")
        self.replica_id = ReplicaID(unique_id, deployment)
        self.multiplexed_model_ids = set(adapters)


def test_an_adapter_s_request_goes_to_a_replica_holding_it_never_by_prefix():
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    r = _router("ModelServer:lora", routing={"min_match_tokens": 1}, block_size=2)
    replicas = [Held("r1"), Held("r2", ("sea@1",)), Held("r3", ("gulf@2", "sea@1"))]
    r._replicas = {x.replica_id: x for x in replicas}
    r._replica_id_set = set(r._replicas)
    r._update_multiplexed_model_ids_with_replicas(replicas)
    prompt = [1, 2, 3, 4, 5, 6]
    r.prefixes.insert_keys(r.prefixes.keys(prompt), "r1")  # the base's prompt went to r1

    def pending(adapter: str) -> PendingRequest:
        request = EngineRequest("q", prompt, SamplingParams(lora=adapter.split("@")[0]))
        return PendingRequest(
            [request], {}, RequestMetadata("q", "q", multiplexed_model_id=adapter)
        )

    async def chosen(adapter: str) -> list[str]:
        ranks = await r.choose_replicas(replicas, pending(adapter))
        return sorted(x.replica_id.unique_id for x in ranks[0])

    async def scenario() -> None:
        for _ in range(20):
            assert await chosen("sea@1") == ["r2", "r3"]
            assert await chosen("gulf@2") == ["r3"]
        # An adapter no replica holds goes to one holding the fewest: r1, prefix or not.
        assert await chosen("bay@3") == ["r1"]

    asyncio.run(scenario())
