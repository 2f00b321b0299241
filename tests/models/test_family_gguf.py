"""GGUF files of the families llama.cpp converts, written the way its converter writes
them (tests/models/gguf_writer.py), against the safetensors checkpoint they came from:
the same architecture read from the metadata, the same greedy tokens and the same
log-probabilities. Log-probabilities catch what greedy tokens of a tiny model may not
show (a lost soft-cap or RoPE factor)."""

from pathlib import Path

import numpy as np
import pytest

from app.models.loader import read_arch
from app.models.source import resolve_model
from app.protocol import ModelLoadError, SamplingParams
from tests.helpers import save_tiny_checkpoint, tiny_engine
from tests.models.family_checkpoints import save_family_checkpoint
from tests.models.gguf_writer import write_gguf
from tests.models.test_families import NEW_TOKENS, PROMPTS

# family -> overrides: llama.cpp files can only say what its runtime runs, Gemma 3 with
# every 6th layer global and Qwen2-MoE with every layer routed.
GGUF_FAMILIES = {
    "qwen3": {},
    "gemma2": {},
    "gemma3": dict(num_hidden_layers=6, layer_types=None),
    "phi3": {},
    "phi4-mini": {},  # LongRoPE factors as tensors, partial RoPE as a dimension count
    "qwen2-moe": dict(mlp_only_layers=[]),
    "qwen3-moe": {},
    "mixtral": {},  # a "llama" file with experts: q/k rows permuted
}


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # short: the test prompts reach past it
}


def _checkpoint_and_gguf(tmp_path: Path, family: str) -> tuple[Path, Path]:
    if family == "llama3.1":  # RoPE scaling carried only as rope_freqs divisors
        directory = save_tiny_checkpoint(
            tmp_path / family, "llama", rope_parameters=LLAMA3_ROPE, initializer_range=0.2
        )
    else:
        directory = save_family_checkpoint(tmp_path / family, family, **GGUF_FAMILIES[family])
    return directory, write_gguf(directory, directory / f"{family}.gguf")


@pytest.mark.parametrize("family", [*sorted(GGUF_FAMILIES), "llama3.1"])
def test_gguf_generates_as_safetensors(family, tmp_path):
    directory, gguf = _checkpoint_and_gguf(tmp_path, family)
    if family == "llama3.1":
        assert read_arch(resolve_model(str(gguf))).rope_scaling["rope_type"] == "divisors"
    else:
        assert read_arch(resolve_model(str(gguf))) == read_arch(resolve_model(str(directory)))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    want = tiny_engine(directory, device="cpu").generate(PROMPTS, params)
    got = tiny_engine(gguf, device="cpu").generate(PROMPTS, params)
    for ours, theirs in zip(got, want, strict=True):
        ours, theirs = ours.outputs[0], theirs.outputs[0]
        assert ours.token_ids == theirs.token_ids, family
        for a, b in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top, strict=True)) < 1e-5


def test_unknown_gguf_tensor_fails_the_load_by_name(tmp_path):
    """A tensor we have no name for (here attention sinks) may change the model: refuse
    it rather than serve the model without it."""
    directory = save_family_checkpoint(tmp_path / "qwen3", "qwen3")
    sinks = {"blk.0.attn_sinks.weight": np.zeros(4, dtype=np.float32)}
    gguf = write_gguf(directory, directory / "sinks.gguf", extra=sinks)
    with pytest.raises(ModelLoadError, match=r"unknown tensor blk\.0\.attn_sinks\.weight"):
        tiny_engine(gguf)
