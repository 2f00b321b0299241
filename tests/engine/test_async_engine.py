"""The asyncio streaming wrapper: deltas, finish reasons, cancellation frees blocks."""

import asyncio

import pytest

from app.engine.async_engine import AsyncEngine
from app.engine.client import EngineDeadError
from app.protocol import FinishReason, InvalidRequestError, SamplingParams
from app.protocol.messages import EngineRequest
from tests.helpers import tiny_engine


@pytest.fixture
def async_engine(tiny_llama):
    engine = AsyncEngine(tiny_engine(tiny_llama, num_kv_blocks=128))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams):
    return [d async for d in engine.generate(EngineRequest(rid, prompt, params))]


def test_streams_match_offline_generate(async_engine):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44], [7] * 9]

    async def main():
        return await asyncio.gather(
            *(collect(async_engine, f"r{i}", p, params) for i, p in enumerate(prompts))
        )

    streams = asyncio.run(main())
    offline = tiny_engine(async_engine.engine.config.model).generate(prompts, params)
    for deltas, ref in zip(streams, offline, strict=True):
        assert [t for d in deltas for t in d.token_ids] == ref.outputs[0].token_ids
        assert [d.finish_reason for d in deltas][-1] == FinishReason.LENGTH
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert deltas[0].num_prompt_tokens == len(ref.prompt_token_ids)


def test_n_outputs_each_finish_once(async_engine):
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    deltas = asyncio.run(collect(async_engine, "n", [5, 6, 7, 8, 9], params))
    finished = sorted(d.index for d in deltas if d.finish_reason is not None)
    assert finished == [0, 1, 2]


def test_cancelled_consumer_aborts_and_frees_blocks(async_engine):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        received = 0
        async for _ in async_engine.generate(EngineRequest("long", [1, 2, 3, 4], params)):
            received += 1
            if received == 3:
                break  # the client went away
        return received

    assert asyncio.run(main()) == 3
    engine = async_engine.engine
    assert "long" not in engine.requests
    assert engine.block_manager.stats().used == 0


def test_bad_request_raises_and_loop_survives(async_engine):
    async def main():
        with pytest.raises(InvalidRequestError):
            await collect(async_engine, "bad", [], SamplingParams())
        return await collect(
            async_engine, "good", [1, 2], SamplingParams(temperature=0, max_tokens=2)
        )

    assert len(asyncio.run(main())) == 2
    async_engine.check_health()


def test_health_fails_when_a_step_hangs(async_engine):
    """A step that never returns (a deadlocked kernel, a hung collective) is caught."""
    import threading

    release = threading.Event()
    real_step = async_engine.engine.step

    def hung_step():
        release.wait(30)
        return real_step()

    async_engine.engine.step = hung_step

    async def main():
        stream = async_engine.generate(
            EngineRequest("hang", [1, 2, 3], SamplingParams(max_tokens=2))
        )
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.5)
        with pytest.raises(EngineDeadError, match="has not completed a step"):
            async_engine.check_health(stuck_after_s=0.2)
        release.set()
        await task
        await stream.aclose()

    asyncio.run(main())
    async_engine.check_health(stuck_after_s=0.2)


def test_dead_loop_fails_streams_and_health(async_engine):
    def broken_step():
        raise RuntimeError("kernel exploded")

    async_engine.engine.step = broken_step

    async def main():
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            await collect(async_engine, "boom", [1, 2, 3], SamplingParams(max_tokens=2))

    asyncio.run(main())
    with pytest.raises(EngineDeadError, match="dead"):
        async_engine.check_health()
    with pytest.raises(EngineDeadError):  # new requests are refused, never hang
        asyncio.run(collect(async_engine, "after", [1, 2], SamplingParams(max_tokens=2)))


def test_contexts_and_queries_through_the_client(async_engine, tmp_path, monkeypatch):
    """AsyncEngine is an EngineClient like EngineProcess: contexts, queries and context
    files, the files written by a worker thread, never by the step loop."""
    import threading

    from app.engine import slot_files
    from app.engine.client import EngineClient
    from app.protocol.messages import ContextAction, ContextOp

    assert isinstance(async_engine, EngineClient)
    assert async_engine.info.model == async_engine.engine.source.name
    writers: list[str] = []
    save = slot_files.save

    def recording_save(*args):  # noqa: ANN002, ANN202
        writers.append(threading.current_thread().name)
        return save(*args)

    monkeypatch.setattr(slot_files, "save", recording_save)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    fill, gen = ContextOp("c", ContextAction.FILL), ContextOp("c", ContextAction.GENERATE)

    async def run(rid: str, tokens: list[int], op: ContextOp) -> list[int]:
        request = EngineRequest(rid, tokens, params, op)
        return [t async for d in async_engine.generate(request) for t in d.token_ids]

    async def main() -> None:
        await run("f", [1, 2, 3, 4, 5], fill)
        out = await run("g", [], gen)
        assert await async_engine.context_tokens("c") == [1, 2, 3, 4, 5] + out
        saved = await async_engine.save_context("c", str(tmp_path / "c.bin"))
        assert saved.num_tokens == 9 and saved.num_bytes == (tmp_path / "c.bin").stat().st_size
        assert await async_engine.restore_context("d", str(tmp_path / "c.bin")) == saved
        assert await async_engine.context_tokens("d") == [1, 2, 3, 4, 5] + out
        assert await async_engine.free_context("c") == 9
        assert (await async_engine.stats())["num_contexts"] == 1
        assert {s.state for s in await async_engine.slots()} == {"idle"}

    asyncio.run(main())
    assert writers and all(name.startswith("shoal-slot-io") for name in writers)
