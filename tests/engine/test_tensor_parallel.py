"""Tensor parallelism on CPU (gloo): rank 0 in an EngineProcess, the other shards as plain
processes. Greedy output must equal TP=1's token for token, logprobs within 1e-4."""

import asyncio
import contextlib
import os
import signal
import time

import pytest
import torch

from app.engine import EngineConfig, LLMEngine
from app.engine.client import EngineDeadError
from app.engine.engine_process import EngineProcess
from app.models.attention_backends import select_backend
from app.models.loader import load_model
from app.models.parallel import TPGroup
from app.models.source import resolve_model
from app.protocol import SamplingParams
from app.protocol.errors import ShoalError
from app.protocol.messages import EngineRequest
from tests.helpers import free_local_address, spawn_local_shards, stop_local_shards, tiny_config

# The engine runs in processes of its own here: the live tier (tests/conftest.py).
pytestmark = pytest.mark.live

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 45))]


@contextlib.contextmanager
def tp_engine(config: EngineConfig):
    """rank 0 (EngineProcess) plus ranks 1..N-1 (`python -m app.engine.shard`)."""
    master = free_local_address()
    shards = spawn_local_shards(config, master)
    engine = None
    try:
        engine = EngineProcess(config, tp_master=master)
        yield engine, shards
    finally:
        if engine is not None:
            engine.shutdown()
        stop_local_shards(shards)


def run_all(engine: EngineProcess, params: SamplingParams) -> list[list]:
    async def one(i: int, prompt: list[int]) -> list:
        return [d async for d in engine.generate(EngineRequest(f"r{i}", prompt, params))]

    async def main() -> list[list]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    return asyncio.run(main())


def assert_same_as(reference: LLMEngine, deltas: list[list], params: SamplingParams) -> None:
    expected = reference.generate(PROMPTS, params)
    for got, want in zip(deltas, expected, strict=True):
        want = want.outputs[0]
        assert [t for d in got for t in d.token_ids] == list(want.token_ids)
        got_lps = [lp for d in got for lp in d.logprobs]
        for a, b in zip(got_lps, want.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top, strict=True)) < 1e-4


def test_tp2_tiny_llama_matches_tp1(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    with tp_engine(tiny_config(tiny_llama, tensor_parallel_size=2, device="cpu")) as (engine, _):
        deltas = run_all(engine, params)
    assert_same_as(LLMEngine(tiny_config(tiny_llama, device="cpu")), deltas, params)


def test_tp3_smollm2_matches_tp1(smollm2_engine):
    """9 query heads and 3 KV heads over 3 shards; float32, like the reference."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        num_threads=1,
        kv_cache_memory_gib=0.25,
        tensor_parallel_size=3,
    )
    with tp_engine(config) as (engine, _):
        deltas = run_all(engine, params)
    assert_same_as(smollm2_engine, deltas, params)


def test_a_dead_shard_ends_streams_and_fails_health(tiny_llama):
    config = tiny_config(tiny_llama, tensor_parallel_size=2, device="cpu").model_copy(
        update={"num_kv_blocks": 256}
    )
    with tp_engine(config) as (engine, shards):

        async def main() -> float:
            params = SamplingParams(max_tokens=500, ignore_eos=True)
            stream = engine.generate(EngineRequest("victim", [1, 2, 3], params))
            await stream.__anext__()
            os.kill(shards[0].pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises((EngineDeadError, ShoalError)):
                async for _ in stream:
                    pass
            return time.monotonic() - killed

        ended_after_s = asyncio.run(asyncio.wait_for(main(), 30))
        assert ended_after_s < 10
        for _ in range(50):
            if not engine.is_alive:
                break
            time.sleep(0.1)
        with pytest.raises(EngineDeadError):
            engine.check_health()


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:  # tied embeddings count once
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def replicated_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)


@pytest.mark.parametrize("size", [3])
def test_each_shard_holds_a_third_of_smollm2(size):
    """Loaded slice by slice (no collectives needed to load): each shard's weights are
    1/N of the model plus the replicated norms, up to the vocabulary's padding."""
    source = resolve_model("default")
    backend = select_backend("torch", torch.device("cpu"))
    whole = load_model(source, backend, torch.float32, torch.device("cpu"))
    total, replicated = weight_bytes(whole.model), replicated_bytes(whole.model)
    del whole
    for rank in range(size):
        shard = load_model(
            source, backend, torch.float32, torch.device("cpu"), tp=TPGroup(rank, size)
        )
        expected = (total - replicated) / size + replicated
        assert abs(weight_bytes(shard.model) - expected) / expected < 0.01
