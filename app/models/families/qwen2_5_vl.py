"""Qwen2.5-VL: a Qwen2 language model (q/k/v biases) whose rotary positions are 3-D
(M-RoPE: each frequency band takes the temporal, row or column position, by
`mrope_section`), behind its vision transformer (app/models/vision/qwen2_5_vl.py), which
loads the checkpoint's `visual.*` itself. For text, the three positions are alike and the
rotation is plain RoPE's; the engine gives an image's tokens theirs (app/engine/mrope.py)."""

import copy
from typing import Any

import torch

from app.models.arch import ArchConfig

ARCHITECTURES = {"Qwen2_5_VLForConditionalGeneration": True}


def language_config(hf_config: Any) -> Any:
    text = getattr(hf_config, "text_config", None) or hf_config
    if text is not hf_config and getattr(hf_config, "tie_word_embeddings", False):
        # transformers 5 keeps a tied checkpoint's flag (Qwen2.5-VL-3B's) on the outer
        # config only, and the checkpoint then has no lm_head
        text = copy.copy(text)
        text.tie_word_embeddings = True
    return text


def read(hf_config: Any, fields: dict[str, Any]) -> dict[str, Any]:
    if "mrope_section" not in fields["rope_scaling"]:
        raise NotImplementedError("a Qwen2.5-VL config without rope mrope_section")
    return fields


def rename(name: str, tensor: torch.Tensor, arch: ArchConfig) -> list[tuple[str, torch.Tensor]]:
    if name.startswith(("visual.", "model.visual.")):
        return []
    if name.startswith("model.language_model."):  # transformers 5's layout
        return [("model." + name.removeprefix("model.language_model."), tensor)]
    return [(name, tensor)]  # the hub's: model.layers.*, lm_head
