"""ContextMoves (deployments/context_moves.py): a drained replica's contexts are parked
and restored where their next call lands, with two real engines. The RoutingState is
the plain object here (its Ray actor is tested live in tests/serve/test_context_affinity.py)."""

import asyncio
import time
import uuid

import pytest

from app.engine.async_engine import AsyncEngine
from app.protocol import SamplingParams
from app.protocol.errors import CapacityError, ConflictError, NotFoundError
from app.protocol.messages import ContextAction, ContextOp, EngineRequest
from deployments import routing_state
from deployments.context_moves import ContextMoves
from deployments.routing_state import RoutingState, SharedRouting
from tests.helpers import tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class InProcessLink(SharedRouting):
    """SharedRouting's calls, answered by a RoutingState in this process (its object
    store puts: the bytes themselves, see `no_object_store`)."""

    def __init__(self, state: RoutingState) -> None:
        super().__init__("app", "M", max_blocks=0)
        self.state = state

    def handle(self):  # noqa: ANN201
        return self.state

    async def _call(self, method: str, *args):  # noqa: ANN002, ANN202
        return getattr(self.state, method)(*args)

    def _tell(self, method: str, *args) -> None:  # noqa: ANN002
        getattr(self.state, method)("M", *args)

    async def park(self, context, data, to=None, source=None) -> bool:  # noqa: ANN001
        return self.state.park("M", context, data, to, source)

    async def unpark(self, context: str, replica: str) -> bytes | None:
        blob = self.state.unpark("M", context, replica)
        return None if blob is None else blob[0]


@pytest.fixture(autouse=True)
def no_object_store(monkeypatch):
    monkeypatch.setattr(routing_state.ray, "put", lambda data: data)


async def generate(engine: AsyncEngine, moves: ContextMoves, cid: str, tokens: list[int]):  # noqa: ANN201
    op = ContextOp(cid, ContextAction.GENERATE)
    await moves.bring(op)
    moves.seen(op)
    request = EngineRequest(uuid.uuid4().hex, tokens, GREEDY, context=op)
    out = []
    async for delta in engine.generate(request):
        out += delta.token_ids
    return out


def test_a_drained_replicas_context_is_restored_where_its_next_call_lands(tiny_llama):
    state = RoutingState()
    drained = AsyncEngine(tiny_engine(tiny_llama))
    survivor = AsyncEngine(tiny_engine(tiny_llama))
    unmoved = AsyncEngine(tiny_engine(tiny_llama))
    a = ContextMoves(drained, InProcessLink(state), "r1")
    b = ContextMoves(survivor, InProcessLink(state), "r2")
    plain = ContextMoves(unmoved, None, "r3")

    async def scenario() -> None:
        history = list(range(5, 40))
        first = await generate(drained, a, "ctx", history)
        assert first == await generate(unmoved, plain, "ctx", history)
        assert await a.send_away() == 1 and ("M", "ctx") in state.parked
        before = (await survivor.stats())["num_prompt_tokens"]
        moved = await generate(survivor, b, "ctx", [7, 8])
        computed = (await survivor.stats())["num_prompt_tokens"] - before
        assert moved == await generate(unmoved, plain, "ctx", [7, 8])
        assert computed <= 4  # the new tokens and the last one, not 39 + 4 of history
        assert state.where("M", "ctx") == "r2" and not state.parked
        assert await generate(survivor, b, "other", [1, 2, 3])  # nothing parked: as before

    try:
        asyncio.run(scenario())
    finally:
        for engine in (drained, survivor, unmoved):
            engine.shutdown()


def test_a_context_that_does_not_fit_stays_parked_and_one_of_another_model_is_dropped(
    tiny_llama, tmp_path
):
    state = RoutingState()
    source = AsyncEngine(tiny_engine(tiny_llama))
    small = AsyncEngine(tiny_engine(tiny_llama, num_kv_blocks=4))
    a = ContextMoves(source, InProcessLink(state), "r1")
    b = ContextMoves(small, InProcessLink(state), "r2")

    async def scenario() -> None:
        await generate(source, a, "big", list(range(5, 60)))  # 14+ blocks of 4
        await a.send_away()
        with pytest.raises(CapacityError):
            await generate(small, b, "big", [1])
        assert ("M", "big") in state.parked  # for a replica with room
        state.parked[("M", "junk")] = ([b"not a slot file"], time.monotonic(), 0.0)
        assert await generate(small, b, "junk", [1, 2])  # dropped: a new context
        assert ("M", "junk") not in state.parked

    try:
        asyncio.run(scenario())
    finally:
        source.shutdown()
        small.shutdown()


def test_an_operator_move_sends_a_live_context_to_the_named_replica(tiny_llama):
    state = RoutingState()
    source = AsyncEngine(tiny_engine(tiny_llama))
    target = AsyncEngine(tiny_engine(tiny_llama))
    unmoved = AsyncEngine(tiny_engine(tiny_llama))
    a = ContextMoves(source, InProcessLink(state), "r1")
    b = ContextMoves(target, InProcessLink(state), "r2")
    plain = ContextMoves(unmoved, None, "r3")

    async def scenario() -> None:
        history = list(range(5, 40))
        await generate(source, a, "ctx", history)
        await generate(unmoved, plain, "ctx", history)
        assert await a.move("ctx", "r2") == len(history) + GREEDY.max_tokens
        assert state.where("M", "ctx") == "r2" and "ctx" not in a.held
        with pytest.raises(NotFoundError):
            await source.context_tokens("ctx")  # freed where it was
        with pytest.raises(NotFoundError):
            await a.move("ctx", "r2")  # not held here any more
        before = (await target.stats())["num_prompt_tokens"]
        moved = await generate(target, b, "ctx", [7, 8])
        assert (await target.stats())["num_prompt_tokens"] - before <= 4
        assert moved == await generate(unmoved, plain, "ctx", [7, 8])

        # A context in use is not moved (409): it stays, nothing parked.
        long = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
        op = ContextOp("busy", ContextAction.GENERATE)
        a.seen(op)
        stream = source.generate(EngineRequest("q-busy", [1, 2, 3], long, context=op))
        await stream.__anext__()
        with pytest.raises(ConflictError):
            await a.move("busy", "r2")
        assert "busy" in a.held and ("M", "busy") not in state.parked
        await stream.aclose()

    try:
        asyncio.run(scenario())
    finally:
        for engine in (source, target, unmoved):
            engine.shutdown()


def test_a_failed_restore_leaves_the_context_parked(tiny_llama):
    state = RoutingState()
    source = AsyncEngine(tiny_engine(tiny_llama))
    target = AsyncEngine(tiny_engine(tiny_llama))
    a = ContextMoves(source, InProcessLink(state), "r1")
    b = ContextMoves(target, InProcessLink(state), "r2")

    async def broken(*args):  # noqa: ANN002, ANN202
        raise RuntimeError("the engine went away")

    async def scenario() -> None:
        await generate(source, a, "ctx", list(range(5, 30)))
        assert await a.send_away() == 1
        target.restore_context = broken
        with pytest.raises(RuntimeError):
            await generate(target, b, "ctx", [7])
        assert ("M", "ctx") in state.parked and state.parked[("M", "ctx")][2] == 0.0
        del target.restore_context  # the engine's own again
        assert await generate(target, b, "ctx", [7]) and not state.parked

    try:
        asyncio.run(scenario())
    finally:
        source.shutdown()
        target.shutdown()
