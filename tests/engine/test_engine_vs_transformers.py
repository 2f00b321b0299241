"""Greedy output of the real SmolLM2 weights, token for token against transformers."""

import pytest
import torch

from app.engine import EngineConfig, LLMEngine
from app.protocol import SamplingParams

MAX_NEW = 24
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colours:",
    "Explain photosynthesis to a child. " * 6,
    "1, 2, 3, 4, 5,",
    "The quick brown fox jumps over the lazy dog. " * 14,
    "Q: What is the boiling point of water at sea level?\nA:",
    "import numpy as np\n\n# Compute the mean of a list of numbers\n" * 4,
]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    chat = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}], add_generation_prompt=True
    )
    if not isinstance(chat, list):
        chat = chat["input_ids"]
    ids = [smollm2_tokenizer(t).input_ids for t in TEXTS] + [list(chat)]
    assert len({len(p) for p in ids}) >= 8 and max(len(p) for p in ids) > 100
    return ids


@pytest.fixture(scope="module")
def reference(smollm2_hf, prompts) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = smollm2_hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False
            )
            out.append(gen[0, len(p) :].tolist())
    return out


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


def variant(base: LLMEngine, **settings) -> LLMEngine:
    config = EngineConfig(**{**base.config.model_dump(), **settings})
    return LLMEngine(config, loaded=base.loaded)


def test_one_batch_matches_transformers(smollm2_engine, prompts, reference):
    # Its own engine over the shared weights: the session's engine keeps the largest
    # batch any earlier test ran (40 at once in the structured outputs' tests).
    engine = variant(smollm2_engine)
    assert run(engine, prompts) == reference
    assert engine.stats.max_batch_num_seqs == len(prompts)


def test_small_prefill_chunks_match_transformers(smollm2_engine, prompts, reference):
    engine = variant(smollm2_engine, max_num_batched_tokens=32)
    assert run(engine, prompts) == reference


def test_preemption_matches_transformers(smollm2_engine, prompts, reference):
    need = sum(len(p) + MAX_NEW for p in prompts)
    blocks = max(len(p) + MAX_NEW for p in prompts) // 16 + 4
    assert blocks * 16 < need  # cannot hold every sequence at once
    engine = variant(smollm2_engine, num_kv_blocks=blocks)
    assert run(engine, prompts) == reference
    assert engine.stats.num_preemptions > 0
    assert engine.block_manager.stats().used == 0
