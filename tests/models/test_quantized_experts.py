"""MoE experts kept quantized (app/models/quant/experts.py): a GGUF file's experts served
from their own blocks, every active expert of a projection in one kernel call. The
reference is the same file dequantized; the kernels keep x in float32 here unless a test
says it rounds x to int8 (as test_quantized_model.py does for dense layers)."""

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from app.models import quant
from app.models.moe import SparseMoE
from app.models.quant import QuantType
from app.models.quant.experts import DOWN, GATE, UP, QuantizedExperts
from app.models.quantized_model import quantized_bytes
from app.models.quantized_tensor import QuantizedTensor
from app.protocol import SamplingParams
from tests.helpers import assert_close_outputs, cpu_engine
from tests.models.family_checkpoints import save_family_checkpoint
from tests.models.gguf_writer import quantize, write_gguf

Q = gguf.GGMLQuantizationType
PROMPTS = [[5, 17, 99, 4, 250, 8] * 3, list(range(100, 160)), [42, 43]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


@pytest.fixture(autouse=True)
def float_activations(monkeypatch):
    monkeypatch.setattr(quant, "float_activations", True)


def _run(engine) -> list:  # noqa: ANN001
    return [o.outputs[0] for o in engine.generate(PROMPTS, GREEDY)]


def _experts(engine) -> list[SparseMoE]:  # noqa: ANN001
    return [m for m in engine.loaded.model.modules() if isinstance(m, SparseMoE)]


# The K types' 256-weight blocks: experts 256 wide and 256 deep, 8 of them, top-2
K_SHAPE = dict(hidden_size=256, moe_intermediate_size=256, num_experts=8)


@pytest.mark.parametrize(
    ("family", "qtype", "shape"),
    [
        ("qwen3-moe", Q.Q8_0, {}),
        ("mixtral", Q.Q4_0, {}),  # a llama file: q/k rows un-permuted too
        ("qwen2-moe", Q.Q4_1, dict(mlp_only_layers=[])),  # with a shared expert
        ("qwen3-moe", Q.Q4_K, K_SHAPE),
        ("qwen3-moe", Q.Q5_K, K_SHAPE),  # no integer kernel: float activations throughout
    ],
    ids=["qwen3-moe-Q8_0", "mixtral-Q4_0", "qwen2-moe-Q4_1", "qwen3-moe-Q4_K", "qwen3-moe-Q5_K"],
)
def test_quantized_experts_generate_as_their_dequantized_selves(
    tmp_path: Path, monkeypatch, family, qtype, shape
):
    directory = save_family_checkpoint(tmp_path, family, **shape)
    dense_type = Q.Q8_0 if qtype in (Q.Q4_K, Q.Q5_K) else qtype
    path = write_gguf(directory, tmp_path / "moe.gguf", qtype=dense_type, expert_qtype=qtype)
    quantized = cpu_engine(path, quantization="gguf")
    layers = _experts(quantized)
    assert layers and all(m.quantized is not None and m.quantized.ready for m in layers)
    assert all(isinstance(m.quantized.gate_up, quant.PackedWeight) for m in layers)
    assert not any(hasattr(m, "expert_down") for m in layers)  # no float copy kept
    dense = cpu_engine(path, quantization="none")
    assert all(m.quantized is None for m in _experts(dense))
    reference = _run(dense)
    assert_close_outputs(_run(quantized), reference, 1e-4)
    # The layer's Python path over the same grouped products (where the one C++ call
    # does not apply) agrees too.
    monkeypatch.setattr(QuantizedExperts, "routed", lambda *args: None)
    assert_close_outputs(_run(quantized), reference, 1e-4)
    if qtype in (Q.Q4_K, Q.Q5_K):
        model = quantized.loaded.model
        held = quantized_bytes(model) + sum(
            p.numel() * p.element_size() for p in model.parameters()
        )
        size = os.path.getsize(path)
        assert abs(held - size) / size < 0.10, (held, size)
    # With x rounded to int8 per block (the default, as llama.cpp does) a tiny random
    # model's near-ties and top-k routing flip: each row's product is checked against
    # the dense kernel's instead (test_quant_kernels.py, grouped experts).


def test_experts_of_mixed_types_and_types_the_kernels_do_not_run():
    """Gate and up of different types go as two stacked weights; a projection that came
    dequantized (a type without kernels) stays a float stack."""
    experts, inter, hidden = 3, 32, 64
    rng = np.random.default_rng(0)
    floats = {
        (e, part): rng.standard_normal((hidden, inter) if part == DOWN else (inter, hidden)).astype(
            np.float32
        )
        for e in range(experts)
        for part in (GATE, UP, DOWN)
    }
    layer = QuantizedExperts(experts, inter, hidden, torch.float32)
    reference = {}
    for (e, part), w in floats.items():
        if part == DOWN:  # a float piece, as the loader hands a Q3_K tensor
            piece = torch.from_numpy(w)
        else:
            qtype = QuantType.Q4_0 if part == GATE else QuantType.Q8_0
            raw = torch.from_numpy(quantize(w, Q(int(qtype))))
            piece = QuantizedTensor(raw, int(qtype), w.shape[1])
        reference[(e, part)] = piece.dequantize() if part != DOWN else piece
        assert not layer.ready
        layer.set_piece(e, part, piece)
    assert layer.ready and isinstance(layer.gate_up, tuple)
    assert isinstance(layer.down, torch.Tensor) and layer.down.shape == (experts, hidden, inter)
    starts = [0, 2, 2, 5]
    xs = torch.randn(5, hidden)
    got = layer.forward(xs, starts, "silu")
    for e in range(experts):
        rows = xs[starts[e] : starts[e + 1]]
        g, u = rows @ reference[(e, GATE)].T, rows @ reference[(e, UP)].T
        want = (torch.nn.functional.silu(g) * u) @ reference[(e, DOWN)].T
        torch.testing.assert_close(got[starts[e] : starts[e + 1]], want, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="expected"):
        layer.set_piece(0, DOWN, torch.zeros(inter, hidden))
