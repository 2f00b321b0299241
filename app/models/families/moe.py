"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (with a gated shared expert) and
Qwen3-MoE (with q/k norms). Attention is the Llama family's; the MLP is routed."""

from typing import Any

import torch

from app.models.arch import ArchConfig, MoEConfig
from app.models.families.common import sliding_windows

ARCHITECTURES = {
    "MixtralForCausalLM": False,
    "Qwen2MoeForCausalLM": True,
    "Qwen3MoeForCausalLM": False,
}


def read(hf_config: Any, fields: dict[str, Any]) -> dict[str, Any]:
    arch, layers = fields["architecture"], fields["num_layers"]
    experts = getattr(hf_config, "num_local_experts", None) or hf_config.num_experts
    if arch == "MixtralForCausalLM":
        moe = MoEConfig(
            num_experts=experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=fields["intermediate_size"],
            normalize_top_k=True,
            float32_weights=True,
        )
        return {**fields, "moe": moe, "layer_windows": sliding_windows(hf_config, layers)}
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    moe = MoEConfig(
        num_experts=experts,
        top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.moe_intermediate_size,
        normalize_top_k=bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_intermediate_size=getattr(hf_config, "shared_expert_intermediate_size", 0) or 0,
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
    )
    windows = ()
    if getattr(hf_config, "use_sliding_window", False):
        windows = sliding_windows(hf_config, layers)
    return {
        **fields,
        "moe": moe,
        "qk_norm": arch == "Qwen3MoeForCausalLM",
        "layer_windows": windows,
    }


_MIXTRAL_EXPERT_PARTS = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def rename(name: str, tensor: torch.Tensor, arch: ArchConfig) -> list[tuple[str, torch.Tensor]]:
    """Mixtral's `block_sparse_moe.experts.E.w1/w3/w2` under the Qwen-MoE names."""
    if ".block_sparse_moe." in name:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for old, new in _MIXTRAL_EXPERT_PARTS.items():
            name = name.replace(old, new)
    return [(name, tensor)]
