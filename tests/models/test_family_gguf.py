"""GGUF files of the families llama.cpp converts, written the way its converter writes
them (tests/models/gguf_writer.py), against the safetensors checkpoint they came from:
the same architecture read from the metadata, the same greedy tokens and the same
log-probabilities. Log-probabilities catch what greedy tokens of a tiny model may not
show (a lost soft-cap or RoPE factor)."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from app.models.loader import read_arch
from app.models.source import resolve_model
from app.protocol import ModelLoadError, SamplingParams
from tests.helpers import cpu_engine, save_tiny_checkpoint, tiny_engine
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


# On a GPU host the GPU too: the same kernels on both sides, so only the weights' bits
# or the RoPE tables can differ (float32 products on CUDA differed by 1.0e-5 there).
DEVICES = [("cpu", 1e-5)] + ([("cuda", 1e-4)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device,tol", DEVICES, ids=[d for d, _ in DEVICES])
@pytest.mark.parametrize("family", [*sorted(GGUF_FAMILIES), "llama3.1"])
def test_gguf_generates_as_safetensors(family, device, tol, tmp_path):
    directory, gguf = _checkpoint_and_gguf(tmp_path, family)
    if family == "llama3.1":
        assert read_arch(resolve_model(str(gguf))).rope_scaling["rope_type"] == "divisors"
    else:
        assert read_arch(resolve_model(str(gguf))) == read_arch(resolve_model(str(directory)))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    want = tiny_engine(directory, device=device).generate(PROMPTS, params)
    got = tiny_engine(gguf, device=device).generate(PROMPTS, params)
    for ours, theirs in zip(got, want, strict=True):
        ours, theirs = ours.outputs[0], theirs.outputs[0]
        assert ours.token_ids == theirs.token_ids, family
        for a, b in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top, strict=True)) < tol


def test_unknown_gguf_tensor_fails_the_load_by_name(tmp_path):
    """A tensor we have no name for (here attention sinks) may change the model: refuse
    it rather than serve the model without it."""
    directory = save_family_checkpoint(tmp_path / "qwen3", "qwen3")
    sinks = {"blk.0.attn_sinks.weight": np.zeros(4, dtype=np.float32)}
    gguf = write_gguf(directory, directory / "sinks.gguf", extra=sinks)
    with pytest.raises(ModelLoadError, match=r"unknown tensor blk\.0\.attn_sinks\.weight"):
        tiny_engine(gguf)


def test_a_load_parses_its_gguf_once(tmp_path, monkeypatch):
    """Config, quantized targets and weights each read the file's header; gguf's reader
    takes seconds over a real vocabulary, so one load parses it once (transformers'
    own config reader aside), and keeps no reader after it."""
    import gguf as gguf_package

    from app.models import weights

    directory = save_family_checkpoint(tmp_path / "qwen3", "qwen3")
    path = write_gguf(
        directory, directory / "q8.gguf", qtype=gguf_package.GGMLQuantizationType.Q8_0
    )
    ours, real = [], gguf_package.GGUFReader

    def counting(*args, **kwargs):
        if sys._getframe(1).f_globals["__name__"] == weights.__name__:
            ours.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf_package, "GGUFReader", counting)
    engine = cpu_engine(path, quantization="gguf", structured_outputs=False)
    assert engine.loaded.model is not None and ours == [str(path)]
    assert weights._readers.get() is None
    cpu_engine(path, quantization="gguf", structured_outputs=False)
    assert ours == [str(path)] * 2  # the next load reads the file again
