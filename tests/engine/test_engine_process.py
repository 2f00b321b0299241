"""The engine in a child process: same streams as in-process, errors, aborts, death."""

import asyncio
import os
import signal
import time

import pytest

from app.engine import EngineConfig
from app.engine.client import EngineDeadError
from app.engine.engine_process import EngineProcess
from app.protocol import FinishReason, SamplingParams
from app.protocol.errors import ShoalError
from app.protocol.messages import EngineRequest
from tests.helpers import tiny_config, tiny_engine

# The engine runs in processes of its own here: the live tier (tests/conftest.py).
pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def engine_process(tiny_llama):
    proc = EngineProcess(tiny_config(tiny_llama))
    yield proc
    proc.shutdown()


async def collect(
    engine, rid: str, prompt: list[int], params: SamplingParams, context=None
) -> list:  # noqa: ANN001
    return [d async for d in engine.generate(EngineRequest(rid, prompt, params, context))]


def test_streams_match_the_in_process_engine(engine_process, tiny_llama):
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [
        list(o.outputs[0].token_ids) for o in tiny_engine(tiny_llama).generate(prompts, params)
    ]

    async def main() -> list[list]:
        return await asyncio.gather(
            *(collect(engine_process, f"r{i}", p, params) for i, p in enumerate(prompts))
        )

    for deltas, want in zip(asyncio.run(main()), expected, strict=True):
        assert [t for d in deltas for t in d.token_ids] == want
        assert deltas[-1].finish_reason == FinishReason.LENGTH


def test_bad_request_gets_its_error_and_the_engine_survives(engine_process):
    async def main() -> None:
        with pytest.raises(ShoalError) as info:
            await collect(engine_process, "bad", [1, 10_000], SamplingParams(max_tokens=2))
        assert info.value.status_code == 400 and "vocabulary" in info.value.message
        assert len(await collect(engine_process, "ok", [1, 2], SamplingParams(max_tokens=2))) == 2

    asyncio.run(main())
    engine_process.check_health()


def test_consumer_that_leaves_aborts_and_frees_blocks(engine_process):
    async def main() -> dict:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = engine_process.generate(EngineRequest("long", [1, 2, 3], params))
        await stream.__anext__()
        assert (await engine_process.stats())["kv_blocks_used"] > 0
        await stream.aclose()
        for _ in range(100):
            stats = await engine_process.stats()
            if stats["kv_blocks_used"] == 0 and stats["num_running"] == 0:
                return stats
            await asyncio.sleep(0.05)
        return stats

    stats = asyncio.run(main())
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


def test_contexts_and_queries_through_the_process(engine_process, tiny_llama, tmp_path):
    """Every EngineClient query crosses the wire as neutral values; errors keep their
    status codes."""
    from app.engine.client import EngineClient
    from app.protocol.messages import ContextAction, ContextOp
    from app.protocol.outputs import ContextFile, EngineInfo

    assert isinstance(engine_process, EngineClient)
    assert engine_process.info == EngineInfo(str(tiny_llama), 512)
    fill = ContextOp("p", ContextAction.FILL)
    gen = ContextOp("p", ContextAction.GENERATE)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main() -> None:
        assert len(await collect(engine_process, "f", [1, 2, 3, 4, 5], params, fill)) == 1
        out = await collect(engine_process, "g", [6], params, gen)
        tokens = [1, 2, 3, 4, 5, 6] + [t for d in out for t in d.token_ids]
        assert await engine_process.context_tokens("p") == tokens
        saved = await engine_process.save_context("p", str(tmp_path / "p.bin"))
        assert saved == ContextFile(len(tokens), (tmp_path / "p.bin").stat().st_size)
        restored = await engine_process.restore_context("q", str(tmp_path / "p.bin"))
        assert restored == saved
        assert await engine_process.context_tokens("q") == tokens
        slots = await engine_process.slots()
        assert [s.state for s in slots] == ["idle"] * 128  # max_num_seqs
        assert await engine_process.free_context("p") == len(tokens)
        assert await engine_process.free_context("q") == len(tokens)
        with pytest.raises(ShoalError) as info:
            await engine_process.context_tokens("p")
        assert info.value.status_code == 404

    asyncio.run(main())


def test_model_load_error_reaches_the_parent(tmp_path):
    with pytest.raises(ShoalError, match="does-not-exist"):
        EngineProcess(tiny_config(tmp_path / "does-not-exist"))


def test_killed_engine_ends_streams_and_fails_health(tiny_llama):
    proc = EngineProcess(tiny_config(tiny_llama, num_kv_blocks=256))
    try:

        async def main() -> None:
            params = SamplingParams(max_tokens=500, ignore_eos=True)
            stream = proc.generate(EngineRequest("victim", [1, 2], params))
            await stream.__anext__()
            os.kill(proc._proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                await collect(proc, "after", [1, 2], SamplingParams(max_tokens=2))

        asyncio.run(asyncio.wait_for(main(), 30))
        with pytest.raises(EngineDeadError, match="exited"):
            proc.check_health()
    finally:
        proc.shutdown()


def test_slot_files_are_written_off_the_step_loop(tmp_path):
    """Saving a long context (SmolLM2, 3000 tokens: over 50 MB of KV) runs beside the step
    loop: a stream on the same engine keeps getting tokens while the file is written."""
    from app.protocol.messages import ContextAction, ContextOp

    proc = EngineProcess(EngineConfig(kv_cache_memory_gib=0.25, num_threads=2))
    try:

        async def main() -> tuple[int, float, int]:
            ids = [100 + (i * 7919) % 40000 for i in range(3000)]
            fill = ContextOp("big", ContextAction.FILL)
            async for _ in proc.generate(
                EngineRequest("fill", ids, SamplingParams(max_tokens=1), fill)
            ):
                pass
            params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            stream = proc.generate(EngineRequest("stream", [1, 2, 3], params))
            await anext(stream)
            arrivals: list[float] = []

            async def consume() -> None:
                async for _ in stream:
                    arrivals.append(time.monotonic())

            consumer = asyncio.create_task(consume())
            await asyncio.sleep(0.5)
            started = time.monotonic()
            saved = await proc.save_context("big", str(tmp_path / "big.bin"))
            ended = time.monotonic()
            consumer.cancel()
            during = sum(1 for t in arrivals if started < t < ended)
            assert saved.num_tokens == len(ids)
            return during, ended - started, saved.num_bytes

        during, seconds, size = asyncio.run(main())
        print(f"save of {size / 1e6:.0f} MB took {seconds:.2f} s; {during} deltas meanwhile")
        assert size > 50e6
        assert during >= 2, "the step loop waited for the file"
        proc.check_health()
    finally:
        proc.shutdown()


def test_first_requests_after_ready_are_as_quick_as_warm_ones():
    """When EngineProcess returns (what a replica's constructor, and so Serve's readiness,
    waits for) the real model's first constrained request and first plain one wait for
    nothing a later one does not: the grammar's vocabulary and the first-request set-up
    are done (they once loaded behind a replica that already said it was ready)."""
    import json

    from app.protocol.sampling import Constraint, ConstraintKind

    def constraint(field: str) -> Constraint:
        schema = {"type": "object", "properties": {field: {"type": "integer"}}}
        return Constraint(kind=ConstraintKind.JSON, spec=json.dumps(schema))

    async def ttft(engine: EngineProcess, rid: str, c: Constraint | None) -> float:
        params = SamplingParams(max_tokens=2, constraint=c)
        started = time.perf_counter()
        stream = engine.generate(EngineRequest(rid, [5, 6, 7, 8], params))
        await stream.__anext__()
        took = time.perf_counter() - started
        await stream.aclose()
        return took

    async def main(engine: EngineProcess) -> list[float]:
        # first ones, then warm ones of the same kinds (a new schema each: compiling one
        # is part of every constrained request's first token)
        kinds = [constraint("a"), None, constraint("b"), None]
        return [await ttft(engine, f"r{i}", c) for i, c in enumerate(kinds)]

    engine = EngineProcess(EngineConfig(kv_cache_memory_gib=0.25))
    try:
        first_constrained, first_plain, warm_constrained, warm_plain = asyncio.run(main(engine))
    finally:
        engine.shutdown()
    # a small factor, with room for a busy machine's scheduling jitter
    assert first_constrained < 4 * warm_constrained + 0.1, (first_constrained, warm_constrained)
    assert first_plain < 4 * warm_plain + 0.1, (first_plain, warm_plain)
