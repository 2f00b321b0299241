"""Fused decode layers (app/models/quant/fused_decode.py): a step of decodes in one C++
call per layer returns what the Python layers return, bit for bit: the same tokens and
the same log-probabilities, whatever the batch (GEMV or tiles), the activations, a
sliding window or a q/k/v bias. Prefix caching is off so that both runs prefill alike.
Which models take the fused layers: the families as before (now with Qwen3's q/k norms
and experts kept quantized), nothing ArchConfig gains."""

import dataclasses
from pathlib import Path

import gguf
import pytest
import torch
from torch import nn

from app.engine import EngineConfig, LLMEngine
from app.engine import config as engine_config
from app.models import quant
from app.models.arch import ArchConfig
from app.models.quant.fused_decode import fuse_decode_layers, unfused_fields
from app.models.quant.linear_module import QuantLinear
from app.models.quantized_tensor import QuantizedTensor
from app.protocol import SamplingParams
from tests.helpers import cpu_engine, save_tiny_checkpoint
from tests.models.family_checkpoints import FAMILIES, WINDOW, save_family_checkpoint
from tests.models.gguf_writer import write_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def default_engine(smollm2_quantized) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            device="cpu",  # the fused layers are the CPU path, also on a GPU host
            dtype="float32",
            num_threads=2,
            kv_cache_memory_gib=0.1,
            enable_prefix_caching=False,
        ),
        loaded=smollm2_quantized.loaded,
    )


def _generate(engine: LLMEngine, prompts: list[list[int]], fused: bool) -> list:
    """Tokens and log-probabilities of each prompt, and how many layer calls were fused."""
    model = engine.loaded.model.model
    model.fused_decode = fused
    first = model.layers[0]
    native, calls = first.fused_decode, []
    first.fused_decode = lambda *args: calls.append(1) or native(*args)
    try:
        outputs = [o.outputs[0] for o in engine.generate(prompts, GREEDY)]
    finally:
        first.fused_decode = native
        model.fused_decode = True
    return [(o.token_ids, o.logprobs) for o in outputs], len(calls)


def _assert_same(engine: LLMEngine, prompts: list[list[int]]) -> None:
    fused, calls = _generate(engine, prompts, fused=True)
    python, none = _generate(engine, prompts, fused=False)
    assert calls >= GREEDY.max_tokens - 1 and none == 0
    assert fused == python


def _prompts(batch: int) -> list[list[int]]:
    return [list(range(100 + 7 * i, 120 + 9 * i)) for i in range(batch)]


def _tiny_prompts(batch: int) -> list[list[int]]:  # within a tiny checkpoint's vocabulary
    return [list(range(10 + 5 * i, 30 + 6 * i)) for i in range(batch)]


@pytest.mark.parametrize("batch", [1, 5, 20])
def test_default_model_fused_equals_python(default_engine: LLMEngine, batch: int):
    assert default_engine.loaded.model.model.fused_decode
    assert not quant.float_activations  # int8, the default: the GEMV at any batch
    _assert_same(default_engine, _prompts(batch))


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_16_bit_cache_fused_equals_python(default_engine: LLMEngine, kv_cache_dtype: str):
    """A float32 model over a 16-bit KV cache (float16 is what kv_cache_dtype 'auto' picks
    for the default GGUF on AVX-512 or AVX2): both paths round keys and values alike and read
    them alike."""
    engine = LLMEngine(
        EngineConfig(
            device="cpu",
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            num_threads=2,
            kv_cache_memory_gib=0.05,
            enable_prefix_caching=False,
        ),
        loaded=default_engine.loaded,
    )
    assert engine.runner.k_caches[0].dtype == getattr(torch, kv_cache_dtype)
    assert engine.runner.dtype == torch.float32
    _assert_same(engine, _prompts(5))


@pytest.mark.parametrize("batch", [3, 20])  # 20 > the float GEMV's 16 rows: tiles
def test_float_activations_fused_equals_python(default_engine: LLMEngine, monkeypatch, batch: int):
    monkeypatch.setattr(quant, "float_activations", True)
    _assert_same(default_engine, _prompts(batch))


def test_qkv_bias_fused_equals_python(default_engine: LLMEngine):
    model = default_engine.loaded.model
    generator = torch.Generator().manual_seed(0)
    layers = model.model.layers
    try:
        for layer in layers:
            proj = layer.self_attn.qkv_proj
            proj.bias = nn.Parameter(
                torch.randn(proj.out_features, generator=generator) * 0.5, requires_grad=False
            )
        assert fuse_decode_layers(model)
        _assert_same(default_engine, [list(range(300, 330)), [7, 8, 9]])
    finally:
        for layer in layers:
            layer.self_attn.qkv_proj.bias = None
        assert fuse_decode_layers(model)


def test_mixed_types_in_one_layer_fused_equals_python(default_engine: LLMEngine):
    """q|k of one type and v of another (as Q4_K_M files keep v in Q6_K): two kernel
    runs side by side in one output."""
    model = default_engine.loaded.model
    layers = model.model.layers
    originals = [layer.self_attn.qkv_proj for layer in layers]
    try:
        for layer, qkv in zip(layers, originals, strict=True):
            w = quant.dequantize_packed(qkv.runs()[0][0]).numpy()
            rows = qkv.segment_rows
            mixed = QuantLinear(qkv.in_features, rows)
            starts = [0, rows[0], rows[0] + rows[1], sum(rows)]
            for i, qtype in enumerate(("Q8_0", "Q8_0", "Q4_0")):
                part = w[starts[i] : starts[i + 1]]
                gtype = getattr(gguf.GGMLQuantizationType, qtype)
                raw = torch.from_numpy(gguf.quants.quantize(part, gtype))
                mixed.set_segment(i, QuantizedTensor(raw, int(gtype), qkv.in_features))
            layer.self_attn.qkv_proj = mixed
        assert len(layers[0].self_attn.qkv_proj.runs()) == 2
        assert fuse_decode_layers(model)
        _assert_same(default_engine, [list(range(300, 330)), [7, 8, 9]])
    finally:
        for layer, qkv in zip(layers, originals, strict=True):
            layer.self_attn.qkv_proj = qkv
        assert fuse_decode_layers(model)


def test_sliding_window_fused_equals_python(tmp_path: Path):
    # Phi-3's GGUF keeps its window (a Llama file has none); its q|k|v come fused.
    directory = save_family_checkpoint(tmp_path, "phi3", sliding_window=WINDOW)
    path = write_gguf(directory, directory / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    engine = cpu_engine(path, quantization="gguf", enable_prefix_caching=False)
    model = engine.loaded.model.model
    assert model.fused_decode
    assert all(layer.self_attn.attn_options == {"window": WINDOW} for layer in model.layers)
    prompts = [list(range(10, 10 + n)) for n in (3, WINDOW + 5, 3 * WINDOW)]
    _assert_same(engine, prompts)


def test_qk_norms_fused_equals_python(tmp_path: Path):
    directory = save_family_checkpoint(tmp_path, "qwen3")  # q/k norms
    path = write_gguf(directory, directory / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    engine = cpu_engine(path, quantization="gguf", enable_prefix_caching=False)
    assert engine.loaded.model.model.fused_decode
    _assert_same(engine, _tiny_prompts(5))
    assert not cpu_engine(path, quantization="none").loaded.model.model.fused_decode


@pytest.mark.parametrize(
    ("family", "experts", "shape"),
    [
        ("qwen3-moe", "Q8_0", {}),
        ("mixtral", "Q4_0", {}),
        ("qwen3-moe", "Q4_K", dict(hidden_size=256, moe_intermediate_size=256, num_experts=8)),
        ("qwen2-moe", "Q4_1", dict(mlp_only_layers=[])),  # a shared expert, its gate Q8_0
    ],
)
def test_moe_fused_equals_python(tmp_path: Path, monkeypatch, family, experts, shape):
    """Routed experts kept quantized, in the layer's one call (router float32, as
    llama.cpp files keep it; then quantized too; a shared expert's gate quantized, then
    float32): the Python layer's bits, int8 and float activations."""
    directory = save_family_checkpoint(tmp_path, family, **shape)
    q8, kind = gguf.GGMLQuantizationType.Q8_0, getattr(gguf.GGMLQuantizationType, experts)
    path = write_gguf(directory, directory / "moe.gguf", qtype=q8, expert_qtype=kind)
    engine = cpu_engine(path, quantization="gguf", enable_prefix_caching=False)
    model = engine.loaded.model
    assert model.model.fused_decode
    assert all(isinstance(layer.mlp.gate, nn.Linear) for layer in model.model.layers)
    _assert_same(engine, _tiny_prompts(5))
    for layer in model.model.layers:  # a quantized router
        w = layer.mlp.gate.weight.detach().numpy()
        gate = QuantLinear(w.shape[1], [w.shape[0]])
        raw = torch.from_numpy(gguf.quants.quantize(w, q8))
        gate.set_segment(0, QuantizedTensor(raw, int(q8), w.shape[1]))
        layer.mlp.gate = gate
        if layer.mlp.shared_expert_gate is not None:  # as llama-quantize leaves it
            assert isinstance(layer.mlp.shared_expert_gate, QuantLinear)
            quantized_gate = layer.mlp.shared_expert_gate
            layer.mlp.shared_expert_gate = nn.Linear(w.shape[1], 1, bias=False)
            dense = quantized_gate(torch.eye(w.shape[1])).T.contiguous()  # (1, hidden)
            layer.mlp.shared_expert_gate.weight.data.copy_(dense)
    assert fuse_decode_layers(model)
    _assert_same(engine, _tiny_prompts(5))
    monkeypatch.setattr(quant, "float_activations", True)
    _assert_same(engine, _tiny_prompts(20))


@pytest.mark.parametrize("family", ["qwen2-moe", "qwen3-moe"])
def test_moe_of_16_bit_activations_loads_on_python(tmp_path: Path, family: str):
    """bfloat16 hidden states get their float routers and gates prepacked (PackedLinear,
    no .weight): the fused layer is not for them, and asking must not fail the load."""
    shape = dict(mlp_only_layers=[]) if family == "qwen2-moe" else {}
    directory = save_family_checkpoint(tmp_path, family, **shape)
    q8 = gguf.GGMLQuantizationType.Q8_0
    path = write_gguf(directory, directory / "moe.gguf", qtype=q8, expert_qtype=q8)
    engine = cpu_engine(path, quantization="gguf", dtype="bfloat16")
    assert not engine.loaded.model.model.fused_decode
    assert engine.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids


def test_layers_it_does_not_cover_stay_on_python(tmp_path: Path, monkeypatch):
    directory = save_family_checkpoint(tmp_path, "gemma2")  # sandwich norms, soft-capping
    path = write_gguf(directory, directory / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    assert not cpu_engine(path, quantization="gguf").loaded.model.model.fused_decode
    floats = save_family_checkpoint(tmp_path / "floats", "qwen3-moe")  # experts as floats
    floats_gguf = write_gguf(floats, floats / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    assert not cpu_engine(floats_gguf, quantization="gguf").loaded.model.model.fused_decode
    llama = save_family_checkpoint(tmp_path / "llama", "mistral-window")
    llama_gguf = write_gguf(llama, llama / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    assert cpu_engine(llama_gguf, quantization="gguf").loaded.model.model.fused_decode
    monkeypatch.setenv("SHOAL_FUSED_DECODE", "0")
    engine = cpu_engine(llama_gguf, quantization="gguf")
    assert not engine.loaded.model.model.fused_decode
    assert engine.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids


def test_auto_dtype_keeps_a_bf16_cpu_on_the_fused_path(tmp_path: Path, monkeypatch):
    """On a CPU with bfloat16 instructions 'auto' means bfloat16, but quantized weights
    compute in float32: the fused layers need it (bfloat16 activations there took the
    Python path, 1.6x slower per token). Float weights still get bfloat16, from a GGUF
    file too."""
    monkeypatch.setattr(engine_config, "cpu_has_bf16", lambda: True)
    directory = save_family_checkpoint(tmp_path, "phi3")
    path = write_gguf(directory, directory / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    quantized = cpu_engine(path, dtype="auto")
    assert quantized.runner.dtype == torch.float32
    # float16 keys and values where the kernels read them in vectors (kv_cache_dtype 'auto')
    vectorised = quantized.runner.backend.reads_16_bit_cache_fast
    assert quantized.runner.kv_dtype == (torch.float16 if vectorised else torch.float32)
    assert quantized.runner.k_caches[0].dtype == quantized.runner.kv_dtype
    assert quantized.loaded.model.model.fused_decode
    assert cpu_engine(path, dtype="auto", quantization="int8").runner.dtype == torch.float32
    assert cpu_engine(path, dtype="auto", quantization="none").runner.dtype == torch.bfloat16
    assert cpu_engine(directory, dtype="auto").runner.dtype == torch.bfloat16
    floats = write_gguf(directory, directory / "f32.gguf")
    assert cpu_engine(floats, dtype="auto").runner.dtype == torch.bfloat16


def test_kv_cache_dtype_is_the_models_or_16_bits_under_float32(tmp_path: Path, monkeypatch):
    # 'auto' on a CPU without bfloat16 instructions: float32 models, a 16-bit cache only
    # for a quantized one, and only where the kernels read it in vectors
    monkeypatch.setattr(engine_config, "cpu_has_bf16", lambda: False)
    directory = save_family_checkpoint(tmp_path, "qwen3")
    floats = cpu_engine(directory, dtype="auto")
    assert floats.runner.dtype == floats.runner.kv_dtype == torch.float32
    quantized = cpu_engine(directory, dtype="auto", quantization="int8")
    vectorised = quantized.runner.backend.reads_16_bit_cache_fast
    assert quantized.runner.kv_dtype == (torch.float16 if vectorised else torch.float32)
    assert (
        cpu_engine(directory, dtype="float32", quantization="int8").runner.kv_dtype == torch.float32
    )
    # asked for: either 16-bit type under float32, twice the blocks in the same budget
    budget = dict(num_kv_blocks=None, kv_cache_memory_gib=0.001)
    f32 = cpu_engine(directory, dtype="float32", **budget).runner.num_blocks
    for kv in ("float16", "bfloat16"):
        engine = cpu_engine(directory, dtype="float32", kv_cache_dtype=kv)
        assert engine.runner.k_caches[0].dtype == getattr(torch, kv)
        halved = cpu_engine(directory, dtype="float32", kv_cache_dtype=kv, **budget)
        assert halved.runner.num_blocks in (2 * f32, 2 * f32 + 1)
    for dtype, kv in (("bfloat16", "float32"), ("bfloat16", "float16"), ("float16", "bfloat16")):
        with pytest.raises(ValueError, match="not supported for a"):
            EngineConfig(dtype=dtype, kv_cache_dtype=kv)


# Whether each family's int8 model takes the fused layers; since the allowlist, only
# what DecodeLayer learned may change (q/k norms: Qwen3; experts and shared experts,
# which int8 keeps as floats: those models' fields now pass, their layers still do not).
FUSED_BEFORE = {
    "llama": True,
    "qwen2": True,  # a q/k/v bias
    "mistral": True,
    "mistral-window": True,
    "phi3": True,
    "qwen3": True,  # q/k norms (DecodeLayer.set_qk_norms)
    "qwen3-yarn": True,
    "gemma2": False,  # sandwich norms, soft-capping, GELU
    "gemma3": False,  # sandwich norms, q/k norms, GELU
    "phi4-mini": False,  # partial RoPE
    "mixtral": False,  # experts not kept quantized under int8
    "qwen2-moe": False,  # experts not kept quantized under int8
    "qwen3-moe": False,  # experts not kept quantized under int8
}
FIELDS_PASS = {
    "mixtral": True,
    "qwen2-moe": True,
    "qwen3-moe": True,
}  # ... though the layers do not fuse
_TINY = ("llama", "qwen2", "mistral")


def test_fused_before_names_every_family():
    assert set(FUSED_BEFORE) == set(FAMILIES) | set(_TINY)


@pytest.mark.parametrize("family", FUSED_BEFORE)
def test_families_fuse_as_before(tmp_path: Path, family: str):
    if family in _TINY:
        directory = save_tiny_checkpoint(tmp_path, family)
    else:
        directory = save_family_checkpoint(tmp_path, family)
    model = cpu_engine(directory, quantization="int8").loaded.model
    assert (not unfused_fields(model.arch)) == FIELDS_PASS.get(family, FUSED_BEFORE[family])
    assert model.model.fused_decode == FUSED_BEFORE[family]


@dataclasses.dataclass(frozen=True)
class _NewSwitch(ArchConfig):
    """ArchConfig with a switch added that FUSED_ARCH does not name."""

    new_switch: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class _NewSetting(ArchConfig):
    """... and with a field that has no default to be neutral at."""

    new_setting: int


def test_a_field_fused_arch_does_not_name_keeps_python(default_engine: LLMEngine):
    model = default_engine.loaded.model
    arch = model.arch
    assert unfused_fields(arch) == []
    fields = {f.name: getattr(arch, f.name) for f in dataclasses.fields(arch)}
    at_default = _NewSwitch(**fields)
    assert unfused_fields(at_default) == []
    switched = dataclasses.replace(at_default, new_switch=0.5)
    assert unfused_fields(switched) == ["new_switch"]
    assert unfused_fields(_NewSetting(**fields, new_setting=0)) == ["new_setting"]
    try:
        model.arch = switched
        assert not fuse_decode_layers(model)
        model.arch = at_default
        assert fuse_decode_layers(model)
    finally:
        model.arch = arch
