"""The image encoder of a multimodal checkpoint, loaded beside its language model: from
the same safetensors files, kept whole on the engine's rank (tensor-parallel shards get
its rows with their step inputs)."""

import logging
from typing import Any

import torch
from torch import nn

from app.models.source import ModelSource
from app.models.vision import gemma3, idefics3, mmproj, mmproj_qwen, qwen2_5_vl
from app.protocol.errors import ModelLoadError

logger = logging.getLogger(__name__)
ENCODERS: dict[str, type[nn.Module]] = {
    **dict.fromkeys(idefics3.ARCHITECTURES, idefics3.Idefics3Vision),
    **dict.fromkeys(gemma3.ARCHITECTURES, gemma3.Gemma3Vision),
    **dict.fromkeys(qwen2_5_vl.ARCHITECTURES, qwen2_5_vl.Qwen25VLVision),
}


def load_vision(
    source: ModelSource,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    mmproj: str | None = None,
) -> nn.Module | None:
    """The checkpoint's encoder, or, with `mmproj`, the one in llama.cpp's projector file
    (mmproj.py); None for a text model (a GGUF file without a projector file is one)."""
    if mmproj is not None:
        return _from_mmproj(source, hf_config, mmproj, dtype, device)
    archs = [a for a in getattr(hf_config, "architectures", None) or [] if a in ENCODERS]
    if not archs or source.is_gguf:
        return None
    from app.models.weights import iter_safetensors

    with torch.device("meta"):
        vision = ENCODERS[archs[0]](hf_config)
    ours = {alias: name for name in vision.state_dict() for alias in _aliases(name)}
    state = {}
    for name, tensor in iter_safetensors(source, ours.__contains__):  # not the decoder's
        state[ours[name]] = tensor
    return _filled(vision, state, source, dtype, device)


def _from_mmproj(
    source: ModelSource, hf_config: Any, path: str, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    kind, meta, reader = mmproj.read_mmproj(path, source.name)
    config = mmproj.model_config(kind, meta, 0, source.name)
    hidden = getattr(getattr(hf_config, "text_config", None) or hf_config, "hidden_size", None)
    if hidden is not None and config.text_config.hidden_size != hidden:
        raise ModelLoadError(
            source.name,
            f"the projector's rows are {config.text_config.hidden_size} wide, the model's "
            f"hidden size {hidden}: it is another model's projector",
        )
    if source.is_gguf:  # the token the processor writes, in the model's own vocabulary
        where = source.directory / str(source.gguf_file)
        token = mmproj.special_token_id(where, mmproj.image_token(kind), source.name)
    else:
        token = int(hf_config.image_token_id)
    config.image_token_id = token
    encoder = {
        "gemma3": gemma3.Gemma3Vision,
        "idefics3": idefics3.Idefics3Vision,
        mmproj_qwen.KIND: qwen2_5_vl.Qwen25VLVision,
    }[kind]
    with torch.device("meta"):
        vision = encoder(config)
    return _filled(vision, mmproj.state_of(kind, reader, source.name), source, dtype, device)


def _filled(
    vision: nn.Module,
    state: dict[str, torch.Tensor],
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    vision = vision.to_empty(device=device)
    expected = set(vision.state_dict())
    missing = expected - set(state)
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise ModelLoadError(source.name, f"{len(missing)} image encoder weights missing: {shown}")
    try:
        vision.load_state_dict(state)
    except RuntimeError as exc:  # a tensor of another shape than its config says
        raise ModelLoadError(source.name, f"image encoder weights do not fit: {exc}") from None
    logger.info("%s: image encoder of %.0fM parameters", source.name, _params(vision) / 1e6)
    return vision.to(dtype).eval().requires_grad_(False)


def _aliases(name: str) -> set[str]:
    """The names checkpoints give an encoder weight: at the top or under `model.`, and
    a SigLIP tower's with or without its inner `vision_model.` (Gemma 3's hub files have
    it; transformers 5 writes them without)."""
    names = {name}
    if name.startswith("vision_tower.vision_model."):
        names.add(name.replace("vision_tower.vision_model.", "vision_tower.", 1))
    return names | {f"model.{n}" for n in names}


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
