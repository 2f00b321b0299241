"""Phi-3, Phi-3.5 and Phi-4: the Llama decoder with q/k/v and gate/up stored fused,
LongRoPE scaling, and (Phi-4-mini) RoPE over part of each head."""

from typing import Any

import torch

from app.models.arch import ArchConfig
from app.models.families.common import rope_parameters, sliding_windows

ARCHITECTURES = {"Phi3ForCausalLM": False}


def read(hf_config: Any, fields: dict[str, Any]) -> dict[str, Any]:
    rope = rope_parameters(hf_config)
    partial = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    scaling = dict(fields["rope_scaling"])
    scaling.pop("partial_rotary_factor", None)
    if scaling.get("rope_type", scaling.get("type")) == "longrope":
        # The default factor is the context growth over the pretraining length.
        scaling.setdefault("max_position_embeddings", fields["max_position_embeddings"])
    rotary_dim = int(fields["head_dim"] * partial)
    return {
        **fields,
        "rope_scaling": scaling,
        "rotary_dim": rotary_dim if rotary_dim != fields["head_dim"] else None,
        "layer_windows": sliding_windows(hf_config, fields["num_layers"]),
    }


def rename(name: str, tensor: torch.Tensor, arch: ArchConfig) -> list[tuple[str, torch.Tensor]]:
    """Split the fused projections into the per-part tensors every other family has, so
    loading and tensor-parallel slicing stay one code path."""
    if ".qkv_proj." in name:
        q, k, v = tensor.split([arch.q_size, arch.kv_size, arch.kv_size], dim=0)
        return [
            (name.replace("qkv_proj", p), t)
            for p, t in (("q_proj", q), ("k_proj", k), ("v_proj", v))
        ]
    if ".gate_up_proj." in name:
        gate, up = tensor.split(arch.intermediate_size, dim=0)
        return [
            (name.replace("gate_up_proj", "gate_proj"), gate),
            (name.replace("gate_up_proj", "up_proj"), up),
        ]
    return [(name, tensor)]
