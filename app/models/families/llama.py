"""Llama 2/3, SmolLM2, TinyLlama, Mistral and Qwen2: the plain pre-norm decoder."""

from typing import Any

from app.models.families.common import sliding_windows

ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}


def read(hf_config: Any, fields: dict[str, Any]) -> dict[str, Any]:
    if fields["architecture"] == "Qwen2ForCausalLM" and not getattr(
        hf_config, "use_sliding_window", False
    ):
        return fields  # Qwen2 configs name a window but do not use it unless told to
    return {**fields, "layer_windows": sliding_windows(hf_config, fields["num_layers"])}
