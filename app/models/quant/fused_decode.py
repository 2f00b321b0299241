"""Steps of a quantized model in one C++ call per decoder layer (decode_layer.cpp).

A 135M model's decode step spends as long in Python between the kernels (module calls,
attribute lookups, small tensors) as in the kernels themselves. For a step whose every
token goes through the decode kernel (decodes; with TorchPagedAttention.token_by_token,
prompt tokens too), DecoderModel hands each layer to its `fused_decode` instead, which
runs the same ops in the same order from C++ and so returns the same bits. Layers the C++ does
not cover (q/k norms, sandwich norms, soft-capping, partial RoPE, experts, float
weights, tensor parallelism, non-float32 activations) leave the whole model on the
Python path. SHOAL_FUSED_DECODE=0 turns it off.
"""

import os
from typing import Any

import torch

from app.models import quant
from app.models.attention import DecodeInputs
from app.models.decoder import DecoderForCausalLM, DecoderLayer
from app.models.dense_mlp import DenseMLP
from app.models.fused_ops import RopeTables
from app.models.quant.linear_module import QuantLinear
from app.models.quant.packed_weight import PackedWeight

RunSpec = tuple[int, list[torch.Tensor], int, int, int]  # qtype, parts, rows, cols, start


class FusedDecodeLayer:
    def __init__(self, native: Any, layer: DecoderLayer) -> None:
        self.native = native
        self.attention = layer.self_attn  # its caches are bound per step (model_runner)

    def __call__(self, rope: RopeTables, h: torch.Tensor, inputs: DecodeInputs) -> torch.Tensor:
        cos, sin = rope
        attn = self.attention
        activations = 1 if quant.float_activations else 0  # kernels.cpp's kFloat, kAuto
        return self.native.forward(
            h,
            cos,
            sin,
            attn.k_cache,
            attn.v_cache,
            inputs.slots,
            inputs.tables,
            inputs.lens,
            activations,
        )


def fuse_decode_layers(model: DecoderForCausalLM) -> bool:
    """Give every layer of `model` a fused decode, or none; whether it did."""
    if os.environ.get("SHOAL_FUSED_DECODE", "1") == "0" or model.tp.enabled:
        return False
    module = quant.load()
    if module is None:
        return False
    fused = [_fuse(module, layer) for layer in model.model.layers]
    if any(f is None for f in fused):
        return False
    for layer, f in zip(model.model.layers, fused, strict=True):
        layer.fused_decode = f
    model.model.fused_decode = True
    return True


def _fuse(module: Any, layer: DecoderLayer) -> FusedDecodeLayer | None:
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if (
        layer.sandwich
        or attn.q_norm is not None
        or not set(attn.attn_options) <= {"window"}
        or attn.rotary_dim != attn.head_dim
        or attn.exact
        or any(n.exact or n.eps != norms[0].eps for n in norms)
        or any(n.weight.dtype != torch.float32 or n.weight.device.type != "cpu" for n in norms)
        or not isinstance(mlp, DenseMLP)
        or mlp.act != "silu"
        or mlp.exact  # its Python path would take torch's silu, not silu_mul
        or mlp.fused is not None
    ):
        return None
    linears = [_runs(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(r is None for r in linears) or any(
        m.bias is not None for m in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    ):
        return None
    qkv, o, gate_up, down = linears
    bias = attn.qkv_proj.bias
    native = module.DecodeLayer(
        norms[0].weight.detach(),
        norms[1].weight.detach(),
        norms[0].eps,
        qkv,
        None if bias is None else bias.detach(),
        o,
        gate_up,
        down,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        attn.scale,
        attn.attn_options.get("window", 0),
    )
    return FusedDecodeLayer(native, layer)


def _runs(linear: Any) -> list[RunSpec] | None:
    """The packed runs of a quantized layer as the C++ takes them; None for anything else."""
    if not isinstance(linear, QuantLinear) or linear.tied_to is not None:
        return None
    specs: list[RunSpec] = []
    for weight, start, _ in linear.runs():
        if not isinstance(weight, PackedWeight):
            return None
        qtype, parts = weight.kernel_args
        specs.append((qtype, parts, weight.n, weight.k, start))
    return specs
