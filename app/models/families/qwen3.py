"""Qwen3: the Llama decoder with an RMSNorm over each query and key head before RoPE."""

from typing import Any

from app.models.families.common import sliding_windows

ARCHITECTURES = {"Qwen3ForCausalLM": False}


def read(hf_config: Any, fields: dict[str, Any]) -> dict[str, Any]:
    windows = ()
    if getattr(hf_config, "use_sliding_window", False):
        windows = sliding_windows(hf_config, fields["num_layers"])
    return {**fields, "qk_norm": True, "layer_windows": windows}
