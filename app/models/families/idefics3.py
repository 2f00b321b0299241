"""Idefics3 and SmolVLM: a Llama language model (SmolLM2's for SmolVLM) behind a SigLIP
image encoder (app/models/vision/idefics3.py), which loads the checkpoint's vision tensors
itself; the decoder takes `model.text_model.*`."""

from typing import Any

import torch

from app.models.arch import ArchConfig

ARCHITECTURES = {
    "Idefics3ForConditionalGeneration": False,
    "SmolVLMForConditionalGeneration": False,
}
VISION_PREFIXES = ("model.vision_model.", "model.connector.")


def language_config(hf_config: Any) -> Any:
    return hf_config.text_config


def read(hf_config: Any, fields: dict[str, Any]) -> dict[str, Any]:
    return fields


def rename(name: str, tensor: torch.Tensor, arch: ArchConfig) -> list[tuple[str, torch.Tensor]]:
    if name.startswith(VISION_PREFIXES):
        return []
    if name.startswith("model.text_model."):
        return [("model." + name.removeprefix("model.text_model."), tensor)]
    return [(name, tensor)]
