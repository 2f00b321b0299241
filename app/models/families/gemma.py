"""Gemma 2 and Gemma 3 (text): the decoder with norms around both sublayers, RMSNorm
scaled by (1 + w), embeddings scaled by sqrt(hidden), GELU, and sliding-window layers
between global ones. Gemma 2 soft-caps attention scores and logits; Gemma 3 norms each
query and key head instead and gives its sliding layers their own RoPE base."""

from typing import Any

import torch

from app.models.arch import ArchConfig
from app.models.families.common import rope_parameters, sliding_windows

ARCHITECTURES = {
    "Gemma2ForCausalLM": False,
    "Gemma3ForCausalLM": False,
    # The multimodal checkpoints (gemma-3-4b-it and up): the language model here, the
    # image encoder in app/models/vision/gemma3.py.
    "Gemma3ForConditionalGeneration": False,
}
_VISION_PARTS = ("vision_tower.", "multi_modal_projector.")


def language_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


def read(hf_config: Any, fields: dict[str, Any]) -> dict[str, Any]:
    gemma3 = fields["architecture"] != "Gemma2ForCausalLM"
    fields = {
        **fields,
        "sandwich_norms": True,
        "norm_weight_offset": 1.0,
        "embed_scale": fields["hidden_size"] ** 0.5,
        "attn_scale": float(hf_config.query_pre_attn_scalar) ** -0.5,
        "attn_softcap": float(getattr(hf_config, "attn_logit_softcapping", None) or 0.0),
        "final_softcap": float(getattr(hf_config, "final_logit_softcapping", None) or 0.0),
        "layer_windows": sliding_windows(hf_config, fields["num_layers"]),
        "qk_norm": gemma3,
    }
    if gemma3:
        local = rope_parameters(hf_config, "sliding_attention")
        theta = local.get("rope_theta") or getattr(hf_config, "rope_local_base_freq", 10000.0)
        if local.get("rope_type", "default") != "default":
            raise NotImplementedError("RoPE scaling on the sliding-window layers")
        fields["local_rope_theta"] = float(theta)
    return fields


def rename(name: str, tensor: torch.Tensor, arch: ArchConfig) -> list[tuple[str, torch.Tensor]]:
    """A multimodal checkpoint's language model under the text model's names; its vision
    tower and projector are the image encoder's (app/models/vision/loading.py)."""
    if any(part in name for part in _VISION_PARTS):
        return []
    for prefix in ("language_model.", "model.language_model."):
        if name.startswith(prefix):
            rest = name.removeprefix(prefix)
            return [(rest if rest.startswith(("model.", "lm_head")) else f"model.{rest}", tensor)]
    return [(name, tensor)]
