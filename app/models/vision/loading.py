"""The image encoder of a multimodal checkpoint, loaded beside its language model: from
the same safetensors files, kept whole on the engine's rank (tensor-parallel shards get
its rows with their step inputs)."""

import logging
from typing import Any

import torch
from torch import nn

from app.models.source import ModelSource
from app.models.vision import idefics3
from app.protocol.errors import ModelLoadError

logger = logging.getLogger(__name__)


def load_vision(
    source: ModelSource, hf_config: Any, dtype: torch.dtype, device: torch.device
) -> nn.Module | None:
    """The checkpoint's encoder, or None for a text model (and for a multimodal one whose
    images we do not read: Gemma 3's for now, and any GGUF file)."""
    archs = set(getattr(hf_config, "architectures", None) or [])
    if not archs & set(idefics3.ARCHITECTURES) or source.is_gguf:
        return None
    from app.models.weights import iter_safetensors

    with torch.device("meta"):
        vision = idefics3.Idefics3Vision(hf_config)
    vision = vision.to_empty(device=device)
    expected = set(vision.state_dict())
    state = {}
    wanted = {f"model.{name}" for name in expected}
    for name, tensor in iter_safetensors(source, wanted.__contains__):  # not the decoder's
        state[name.removeprefix("model.")] = tensor
    missing = expected - set(state)
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise ModelLoadError(source.name, f"{len(missing)} image encoder weights missing: {shown}")
    vision.load_state_dict(state)
    logger.info("%s: image encoder of %.0fM parameters", source.name, _params(vision) / 1e6)
    return vision.to(dtype).eval().requires_grad_(False)


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
