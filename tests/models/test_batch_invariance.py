"""A quantized model's forward is batch-invariant (app/models/quant/__init__.py): a token's
log-probabilities are the same bits whether its prompt came whole, in prefill chunks,
after a cached prefix, or beside other requests. With int8 activations any summation-
order difference upstream of a rounding shows, so this holds only because every part of
the forward computes each token alone (the int8 GEMV at any row count, attention one
query token at a time)."""

import pytest

from app.engine import EngineConfig, LLMEngine
from app.models import quant
from app.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
PROMPT = [1, 504, 3458, 282, 4649, 314, 260, 1345] * 9 + [28, 198]  # 74 tokens
OTHERS = [list(range(200, 260)), [42, 43, 44], list(range(900, 1000))]


@pytest.fixture(scope="module", params=["float32", "float16"])
def kv_cache_dtype(request) -> str:
    """float32, and float16: what kv_cache_dtype 'auto' gives the default GGUF on AVX-512 or AVX2."""
    return request.param


@pytest.fixture(scope="module")
def engines(kv_cache_dtype: str, smollm2_quantized):
    """Engines of one config but the overrides, over one copy of the weights."""
    loaded = smollm2_quantized.loaded

    def make(**overrides) -> LLMEngine:
        nonlocal loaded
        settings = dict(
            device="cpu",
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            num_threads=2,
            kv_cache_memory_gib=0.1,
        )
        settings.update(overrides)
        engine = LLMEngine(EngineConfig(**settings), loaded=loaded)
        loaded = engine.loaded
        return engine

    return make


def _answer(engine: LLMEngine, prompts: list[list[int]]) -> tuple:
    """The first prompt's tokens and log-probabilities."""
    out = engine.generate(prompts, GREEDY)[0].outputs[0]
    return out.token_ids, out.logprobs


@pytest.fixture(scope="module")
def alone(engines) -> tuple:
    assert not quant.float_activations  # the default
    return _answer(engines(enable_prefix_caching=False), [PROMPT])


def test_beside_other_requests(engines, alone):
    assert _answer(engines(enable_prefix_caching=False), [PROMPT, *OTHERS]) == alone


def test_in_prefill_chunks(engines, alone):
    chunked = engines(enable_prefix_caching=False, max_num_batched_tokens=20)
    assert _answer(chunked, [PROMPT, *OTHERS]) == alone


def test_after_a_cached_prefix(engines, alone):
    engine = engines(block_size=16)
    assert engine.runner.kv_dtype == engine.loaded.model.model.layers[0].self_attn.k_cache.dtype
    engine.generate([PROMPT[:50]], GREEDY)  # its first 3 blocks stay cached
    prompt_tokens = engine.stats.num_prompt_tokens
    assert _answer(engine, [PROMPT]) == alone
    assert engine.stats.num_prompt_tokens - prompt_tokens < len(PROMPT)  # a cache hit
