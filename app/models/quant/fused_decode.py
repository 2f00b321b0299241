"""Steps of a quantized model in one C++ call per decoder layer (decode_layer.cpp).

A 135M model's decode step spends as long in Python between the kernels (module calls,
attribute lookups, small tensors) as in the kernels themselves. For a step whose every
token goes through the decode kernel (decodes; with TorchPagedAttention.token_by_token,
prompt tokens too), DecoderModel hands each layer to its `fused_decode` instead, which
runs the same ops in the same order from C++ and so returns the same bits. A model
whose ArchConfig asks for anything the C++ does not run (FUSED_ARCH below: sandwich
norms, soft-capped scores, partial RoPE, a switch added since), or
whose layers it cannot take as loaded (float weights, experts not kept quantized, tensor
parallelism, non-float32 activations), stays whole on the Python path. SHOAL_FUSED_DECODE=0 turns it off.
"""

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from app.models import quant
from app.models.arch import ArchConfig
from app.models.attention import DecodeInputs
from app.models.decoder import DecoderForCausalLM, DecoderLayer
from app.models.dense_mlp import DenseMLP
from app.models.fused_ops import RopeTables
from app.models.moe import SparseMoE
from app.models.quant.linear_module import QuantLinear
from app.models.quant.packed_weight import PackedWeight

RunSpec = tuple[int, list[torch.Tensor], int, int, int]  # qtype, parts, rows, cols, start


def _any(value: Any, arch: ArchConfig) -> bool:
    return True


# What decode_layer.cpp runs: ArchConfig field -> the values it runs that field with.
# An allowlist, not a list of what it cannot run, so that a switch added to ArchConfig
# later keeps quantized models off the fused path (which would skip it: wrong tokens,
# silently) until someone names it here. Every field not named here must hold its
# default, Llama's, which is the layer the C++ computes.
FUSED_ARCH: dict[str, Callable[[Any, ArchConfig], bool]] = {
    # sizes, names and settings outside the decoder layers (embeddings, logits, sampling)
    "architecture": _any,
    "vocab_size": _any,
    "hidden_size": _any,
    "intermediate_size": _any,
    "num_layers": _any,
    "max_position_embeddings": _any,
    "tie_word_embeddings": _any,
    "eos_token_ids": _any,
    "embed_scale": _any,
    "final_softcap": _any,
    # arguments of DecodeLayer (a head_dim its attention cannot take fails there, as it
    # does on the Python path)
    "num_heads": _any,
    "num_kv_heads": _any,
    "head_dim": _any,
    "rms_norm_eps": _any,
    "qkv_bias": _any,
    "attn_scale": _any,
    "layer_windows": _any,
    # in the cos/sin tables DecoderModel passes each layer, or the norm weights it takes
    "rope_theta": _any,
    "rope_scaling": _any,
    "local_rope_theta": _any,
    "norm_weight_offset": _any,  # folded into the weights at load
    # switches the C++ runs one way only
    "hidden_act": lambda act, arch: act == "silu",  # silu_mul
    "rotary_dim": lambda dim, arch: dim in (None, arch.head_dim),  # RoPE over whole heads
    "qk_norm": _any,  # DecodeLayer.set_qk_norms
    # routed experts (DecodeLayer.set_moe), a shared expert (set_shared_expert), dense
    # layers between; float32 weighting is moot, activations being float32
    "moe": _any,
}


def unfused_fields(arch: ArchConfig) -> list[str]:
    """The fields of `arch` that keep its layers off the fused path (FUSED_ARCH)."""
    return [f.name for f in dataclasses.fields(arch) if not _runs_field(f, arch)]


def _runs_field(f: dataclasses.Field[Any], arch: ArchConfig) -> bool:
    value = getattr(arch, f.name)
    if f.name in FUSED_ARCH:
        return FUSED_ARCH[f.name](value, arch)
    if f.default is not dataclasses.MISSING:
        return bool(value == f.default)
    if f.default_factory is not dataclasses.MISSING:
        return bool(value == f.default_factory())
    return False  # no default to be neutral at


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
    if unfused_fields(model.arch):
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
    """The layer as DecodeLayer, or None where its weights or kernels as loaded are not
    what the C++ takes (what the architecture asks for is FUSED_ARCH's to check)."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if attn.q_norm is not None:
        norms += [attn.q_norm, attn.k_norm]
    if any(n.weight.dtype != torch.float32 or n.weight.device.type != "cpu" for n in norms):
        return None  # and a model of other activations has its float linears prepacked
    sparse = isinstance(mlp, SparseMoE)
    experts = _experts(mlp) if sparse else None  # DecodeLayer.set_moe's arguments
    shared = _shared_expert(mlp) if sparse and mlp.shared_expert is not None else None
    if (
        not set(attn.attn_options) <= {"window"}  # the only option DecodeLayer takes
        or attn.exact
        or any(n.exact or n.eps != norms[0].eps for n in norms)
        or not (isinstance(mlp, DenseMLP) or sparse)
        or (sparse and experts is None)
        or (sparse and mlp.shared_expert is not None and shared is None)
        or (not sparse and (mlp.exact or mlp.fused is not None))  # exact: torch's silu
    ):
        return None
    dense = [] if sparse else [mlp.gate_up_proj, mlp.down_proj]
    linears = [_runs(m) for m in (attn.qkv_proj, attn.o_proj, *dense)]
    if any(r is None for r in linears) or any(m.bias is not None for m in (attn.o_proj, *dense)):
        return None
    qkv, o, gate_up, down = linears if dense else [*linears, [], []]
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
    if attn.q_norm is not None:
        native.set_qk_norms(attn.q_norm.weight.detach(), attn.k_norm.weight.detach())
    if experts is not None:
        native.set_moe(*experts)
        if mlp.shared_expert is not None:
            native.set_shared_expert(*shared)
    return FusedDecodeLayer(native, layer)


def _experts(mlp: SparseMoE) -> tuple | None:
    """DecodeLayer.set_moe's arguments for a MoE layer whose experts one C++ call runs
    (QuantizedExperts.routed's conditions), else None."""
    experts = mlp.quantized
    if (
        experts is None
        or mlp.act != "silu"
        or not isinstance(experts.gate_up, PackedWeight)
        or not isinstance(experts.down, PackedWeight)
        or mlp.gate.bias is not None
    ):
        return None
    router = _runs(mlp.gate)
    weight = None
    if router is None:  # a float router (llama.cpp files keep it float32)
        if type(mlp.gate) is not nn.Linear or mlp.gate.weight.dtype != torch.float32:
            return None
        router, weight = [], mlp.gate.weight.detach()
    gu_type, gu_parts = experts.gate_up.kernel_args
    dn_type, dn_parts = experts.down.kernel_args
    return (
        router,
        weight,
        mlp.top_k,
        mlp.normalize,
        gu_type,
        gu_parts,
        dn_type,
        dn_parts,
        mlp.inter,
    )


def _shared_expert(mlp: SparseMoE) -> tuple | None:
    """DecodeLayer.set_shared_expert's arguments, or None where the C++ cannot run it."""
    expert, gate = mlp.shared_expert, mlp.shared_expert_gate
    runs = [_runs(m) for m in (expert.gate_up_proj, expert.down_proj)]
    if expert.exact or expert.fused is not None or expert.act != "silu" or None in runs:
        return None
    if any(m.bias is not None for m in (expert.gate_up_proj, expert.down_proj, gate)):
        return None
    gate_runs, weight = _runs(gate), None
    if gate_runs is None:  # a float gate
        if type(gate) is not nn.Linear or gate.weight.dtype != torch.float32:
            return None
        gate_runs, weight = [], gate.weight.detach()
    return (*runs, gate_runs, weight)


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
