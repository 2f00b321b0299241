"""Model families: which HF architectures we serve and how each reads its config and names
its checkpoint tensors.

A family module has `ARCHITECTURES` (HF architecture name -> whether q/k/v carry a bias by
default), `read(hf_config, fields) -> fields` adding its switches to the common ones, and
optionally `rename(name, tensor)` yielding the checkpoint's tensors under the Llama names
our decoder loads (see app/models/checkpoint_names.py).
"""

from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

import torch

from app.models.arch import ArchConfig
from app.models.families import gemma, idefics3, llama, moe, phi3, qwen2_5_vl, qwen3
from app.models.families.common import common_fields, end_tokens
from app.protocol.errors import ModelLoadError

FAMILY_MODULES: tuple[ModuleType, ...] = (llama, qwen3, gemma, phi3, moe, idefics3, qwen2_5_vl)
FAMILIES: dict[str, ModuleType] = {
    arch: module for module in FAMILY_MODULES for arch in module.ARCHITECTURES
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

# GGUF configs carry a model_type but often no `architectures`.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def family_of(architecture: str) -> ModuleType:
    return FAMILIES[architecture]


def read_arch_config(hf_config: Any, model_name: str) -> ArchConfig:
    archs = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in _MODEL_TYPES:
        archs = [_MODEL_TYPES[model_type]]
    supported = [a for a in archs if a in FAMILIES]
    if not supported:
        raise ModelLoadError(
            model_name,
            f"unsupported architecture {', '.join(archs) or model_type or '?'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    arch = supported[0]
    family = FAMILIES[arch]
    # A multimodal checkpoint's language model has its own config inside.
    language = getattr(family, "language_config", None)
    outer = hf_config
    hf_config = language(hf_config) if language else hf_config
    fields = common_fields(hf_config, arch, family.ARCHITECTURES[arch], model_name)
    if outer is not hf_config and getattr(outer, "eos_token_id", None) is not None:
        # gemma-3-4b-it's end of turn (106) is in the outer config's eos list only.
        fields["eos_token_ids"] = tuple(
            dict.fromkeys(fields["eos_token_ids"] + end_tokens(outer.eos_token_id))
        )
    try:
        fields = family.read(hf_config, fields)
    except NotImplementedError as exc:
        raise ModelLoadError(model_name, f"{arch}: {exc}") from exc
    return ArchConfig(**fields)


def hf_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], arch: ArchConfig, norm_offset: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors under the names our loader knows (the family's `rename`),
    with Gemma's (1 + w) norm scales folded in (`norm_offset`: GGUF files have it folded
    already)."""
    rename = getattr(FAMILIES[arch.architecture], "rename", None)
    offset = arch.norm_weight_offset if norm_offset else 0.0
    for name, tensor in weights:
        if offset and name.endswith("norm.weight"):
            tensor = tensor.float() + offset  # in float32, as transformers adds it
        if rename is None:
            yield name, tensor
        else:
            yield from rename(name, tensor, arch)
