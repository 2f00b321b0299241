"""Weights kept quantized (issue 21's integration): GGUF files served from their own
blocks, and the int8 option for float checkpoints. The reference is the same weights
dequantized, so differences come only from the order of accumulation: the kernels keep x
in float32 here (float_activations), except where a test says it rounds x to int8."""

import os
from pathlib import Path

import gguf
import pytest

from app.engine import EngineConfig, LLMEngine
from app.models import quant
from app.models.quant.linear_module import QuantEmbedding, QuantLinear
from app.models.quantized_model import quantized_bytes
from app.models.source import default_model_path
from app.protocol import ModelLoadError, SamplingParams
from tests.helpers import assert_close_outputs, cpu_engine
from tests.models.family_checkpoints import save_family_checkpoint
from tests.models.gguf_writer import write_gguf

PROMPTS = [[1, 504, 3458, 282, 4649, 314] * 3, list(range(200, 260)), [42, 43]]
TINY_PROMPTS = [[5, 17, 99, 4, 250, 8] * 3, list(range(100, 160)), [42, 43]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


@pytest.fixture(autouse=True)
def float_activations(monkeypatch):
    monkeypatch.setattr(quant, "float_activations", True)


def _run(engine: LLMEngine) -> list:
    prompts = PROMPTS if engine.arch.vocab_size > 1000 else TINY_PROMPTS
    return [o.outputs[0] for o in engine.generate(prompts, GREEDY)]


def test_default_gguf_served_from_its_blocks(smollm2_engine):
    settings = dict(device="cpu", dtype="float32", num_threads=2, kv_cache_memory_gib=0.1)
    quantized = LLMEngine(EngineConfig(quantization="gguf", **settings))
    model = quantized.loaded.model
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.tied_to is not None
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    file_bytes = os.path.getsize(default_model_path())
    held = quantized_bytes(model) + sum(p.numel() * p.element_size() for p in model.parameters())
    assert abs(held - file_bytes) / file_bytes < 0.10
    # the same file dequantized: the session's float engine's weights
    dense = LLMEngine(EngineConfig(quantization="none", **settings), loaded=smollm2_engine.loaded)
    reference = _run(dense)
    assert_close_outputs(_run(quantized), reference, 1e-3)
    # the kernels' default, x rounded to int8 per block as llama.cpp does: the same greedy
    # tokens, log-probabilities mostly a few hundredths off (0.46 at worst when measured)
    quant.float_activations = False
    assert_close_outputs(_run(quantized), reference, 0.75)


def test_quantized_gguf_of_every_row_edit(tmp_path: Path):
    """Rows of quantized blocks un-permuted (llama files: Mixtral), split (Phi-3's fused
    projections) and fused (q|k|v) exactly as floats are."""
    for family in ("qwen3", "phi3", "mixtral"):
        directory = save_family_checkpoint(tmp_path / family, family)
        path = write_gguf(directory, directory / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
        quantized = cpu_engine(path, quantization="gguf")
        layers = [m for m in quantized.loaded.model.modules() if isinstance(m, QuantLinear)]
        assert layers, family
        assert_close_outputs(_run(quantized), _run(cpu_engine(path, quantization="none")), 1e-4)


def test_int8_quantizes_a_float_checkpoint(tmp_path: Path):
    directory = save_family_checkpoint(tmp_path, "qwen3")
    engine = cpu_engine(directory, quantization="int8")
    assert isinstance(engine.loaded.model.model.layers[0].mlp.gate_up_proj, QuantLinear)
    ours, reference = _run(engine), _run(cpu_engine(directory))
    agree = sum(a.token_ids[:4] == b.token_ids[:4] for a, b in zip(ours, reference, strict=True))
    assert agree >= 2  # 8-bit weights: the first greedy steps still follow float32


def test_gguf_quantization_needs_a_gguf_file(tmp_path: Path):
    directory = save_family_checkpoint(tmp_path, "qwen3")
    with pytest.raises(ModelLoadError, match="quantization 'gguf' impossible: the model is not"):
        cpu_engine(directory, quantization="gguf")


def test_without_kernels_gguf_refuses_and_auto_dequantizes(monkeypatch, tmp_path: Path):
    directory = save_family_checkpoint(tmp_path, "qwen3")
    path = write_gguf(directory, directory / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    monkeypatch.setattr(quant, "load", lambda *a, **k: None)
    with pytest.raises(ModelLoadError, match="kernels could not be built"):
        cpu_engine(path, quantization="gguf")
    assert _run(cpu_engine(path, quantization="auto")) is not None  # dequantized instead
