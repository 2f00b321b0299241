"""Checkpoint tensors (under Llama/Qwen-MoE names) into our decoder's fused parameters,
each shard taking its tensor-parallel slice.

Our parameters fuse what checkpoints store apart: q/k/v into qkv_proj, gate/up into
gate_up_proj, and every expert of a layer into stacked (E, ...) tensors. Each checkpoint
tensor therefore fills a *piece* of a parameter; `expected_pieces` lists every piece so
the loader can name what a checkpoint lacks.
"""

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from app.models.arch import ArchConfig
from app.models.moe import SparseMoE
from app.models.parallel import TPGroup, kv_head_range, slice_rows, vocab_range
from app.models.quant.linear_module import QuantEmbedding, QuantLinear
from app.models.quantized_tensor import QuantizedTensor

_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_STACKED = {  # checkpoint part -> (our fused parameter, piece)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
Piece = Callable[[torch.Tensor], torch.Tensor]  # the view of a parameter one tensor fills


def load_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], tp: TPGroup
) -> set[str]:
    """Copy checkpoint tensors into the model; returns the pieces filled."""
    arch, local = model.arch, model.local
    params = dict(model.named_parameters())
    quantized = {
        n: m for n, m in model.named_modules() if isinstance(m, QuantLinear | QuantEmbedding)
    }
    moe_experts = {
        n: m.quantized
        for n, m in model.named_modules()
        if isinstance(m, SparseMoE) and m.quantized is not None
    }
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            continue
        target, key, piece = _target(name, local)
        module_name, _, kind = target.rpartition(".")
        module = quantized.get(module_name)
        if module is not None and kind == "weight":
            module.set_segment(int(key.rpartition("#")[2]) if "#" in key else 0, tensor)
            loaded.add(key)
            continue
        experts = moe_experts.get(module_name)
        if experts is not None:
            expert, part = _expert_piece(key)
            experts.set_piece(expert, part, tensor)
            loaded.add(key)
            continue
        if isinstance(tensor, QuantizedTensor):  # a layer we keep in floats
            tensor = tensor.dequantize()
        if target not in params:
            raise KeyError(f"unexpected tensor {name!r}")
        tensor = _tp_slice(name, tensor, arch, local, tp)
        dest = piece(params[target].data)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        loaded.add(key)
    return loaded


def expected_pieces(model: nn.Module) -> set[str]:
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, QuantEmbedding) or (
            isinstance(module, QuantLinear) and module.tied_to is None
        ):
            rows = getattr(module, "segment_rows", [0])
            if len(rows) == 1:
                names.add(f"{name}.weight")
            else:
                names.update(f"{name}.weight#{i}" for i in range(len(rows)))
        if isinstance(module, SparseMoE) and module.quantized is not None:
            names.update(
                f"{name}.expert_gate_up#{e}.{i}"
                for e in range(module.num_experts)
                for i in range(2)
            )
            names.update(f"{name}.expert_down#{e}" for e in range(module.num_experts))
    for name, param in model.named_parameters():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            names.update(f"{name}#{i}" for i in range(3))
        elif name.endswith("gate_up_proj.weight"):
            names.update(f"{name}#{i}" for i in range(2))
        elif name.endswith(".expert_gate_up"):
            names.update(f"{name}#{e}.{i}" for e in range(param.shape[0]) for i in range(2))
        elif name.endswith(".expert_down"):
            names.update(f"{name}#{e}" for e in range(param.shape[0]))
        else:
            names.add(name)
    return names


def _expert_piece(key: str) -> tuple[int, int]:
    """(expert, part: 0 gate, 1 up, 2 down) of an expert piece's key."""
    kind, _, piece = key.rpartition("#")
    if kind.endswith(".expert_down"):
        return int(piece), 2
    expert, _, part = piece.partition(".")
    return int(expert), int(part)


def target_module(name: str, model: nn.Module) -> str:
    """The module a checkpoint tensor fills (e.g. q_proj's: ...self_attn.qkv_proj)."""
    return _target(name, model.local)[0].rpartition(".")[0]


def piece_rows(module_name: str, linear: nn.Linear, local: ArchConfig) -> list[int]:
    """The rows of each checkpoint piece of a (fused) linear layer, in order."""
    if module_name.endswith(("qkv_proj", "gate_up_proj")):
        return _piece_sizes(module_name, local)
    return [linear.out_features]


def _target(name: str, local: ArchConfig) -> tuple[str, str, Piece]:
    """(our parameter, the piece's key, the view it fills) for a checkpoint tensor."""
    expert = _EXPERT.match(name)
    if expert:
        prefix, e, part = expert.group(1), int(expert.group(2)), expert.group(3)
        if part == "down":
            target = f"{prefix}.expert_down"
            return target, f"{target}#{e}", lambda data: data[e]
        inter = local.moe.intermediate_size
        i = 0 if part == "gate" else 1
        target = f"{prefix}.expert_gate_up"
        return target, f"{target}#{e}.{i}", lambda data: data[e].narrow(0, i * inter, inter)
    for part, (ours, i) in _STACKED.items():
        if f".{part}." in name:
            target = name.replace(part, ours)
            sizes = _piece_sizes(target, local)
            offset, size = sum(sizes[:i]), sizes[i]
            return target, f"{target}#{i}", _rows(offset, size)
    return name, name, lambda data: data


def _rows(offset: int, size: int) -> Piece:
    return lambda data: data.narrow(0, offset, size)


def _piece_sizes(target: str, local: ArchConfig) -> list[int]:
    if "qkv_proj" in target:
        return [local.q_size, local.kv_size, local.kv_size]
    if ".shared_expert." in target:
        return [local.moe.shared_intermediate_size] * 2
    return [local.intermediate_size] * 2


def _tp_slice(
    name: str, tensor: torch.Tensor, arch: ArchConfig, local: ArchConfig, tp: TPGroup
) -> torch.Tensor:
    """This shard's part of a whole checkpoint tensor (the tensor itself at TP=1)."""
    if not tp.enabled:
        return tensor
    if "embed_tokens" in name or name.startswith("lm_head"):
        return slice_rows(tensor, *vocab_range(arch.vocab_size, tp))
    if ".q_proj." in name:
        return tensor.narrow(0, tp.rank * local.q_size, local.q_size)
    if ".k_proj." in name or ".v_proj." in name:
        first, count = kv_head_range(arch, tp)
        return tensor.narrow(0, first * local.head_dim, count * local.head_dim)
    if ".o_proj." in name:
        return tensor.narrow(1, tp.rank * local.q_size, local.q_size)
    # Column-parallel MLPs (dense, shared expert, each routed expert): an equal slice of
    # the intermediate dimension, rows of gate/up and columns of down.
    if ".gate_proj." in name or ".up_proj." in name:
        per = tensor.shape[0] // tp.size
        return tensor.narrow(0, tp.rank * per, per)
    if ".down_proj." in name:
        per = tensor.shape[1] // tp.size
        return tensor.narrow(1, tp.rank * per, per)
    return tensor  # norms, routers, the shared expert's gate: replicated
