"""What every family's config shares: sizes, RoPE, windows, activation."""

from typing import Any

from app.models.arch import SUPPORTED_ROPE_TYPES
from app.protocol.errors import ModelLoadError

_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def common_fields(hf_config: Any, arch: str, qkv_bias: bool, model_name: str) -> dict[str, Any]:
    rope = rope_parameters(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            model_name,
            f"{arch}: unsupported RoPE scaling type {rope_type!r} "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})",
        )
    num_heads = hf_config.num_attention_heads
    return dict(
        architecture=arch,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias or bool(getattr(hf_config, "attention_bias", False)),
        rope_scaling=_scaling(rope, hf_config),
        eos_token_ids=end_tokens(hf_config.eos_token_id),
        hidden_act=activation(hf_config, arch, model_name),
    )


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """transformers >= 5 keeps RoPE settings in `rope_parameters` (per layer type for
    Gemma 3); older ones split them over rope_theta and rope_scaling."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
        if "full_attention" in params or "sliding_attention" in params:
            params = dict(params.get(layer_type or "full_attention") or {})
        return params
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def sliding_windows(hf_config: Any, num_layers: int) -> tuple[int, ...]:
    """Per-layer windows from `layer_types` (or, for older configs, a sliding_window that
    applies to every layer); () when every layer is global."""
    window = getattr(hf_config, "sliding_window", None) or 0
    if not window:
        return ()
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        windows = (window,) * num_layers
    else:
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def activation(hf_config: Any, arch: str, model_name: str) -> str:
    name = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
    if name not in _ACTIVATIONS:
        raise ModelLoadError(
            model_name,
            f"{arch}: unsupported activation {name!r} (supported: {', '.join(sorted(_ACTIVATIONS))})",
        )
    return _ACTIVATIONS[name]


def end_tokens(eos: Any) -> tuple[int, ...]:
    return tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))


def _scaling(rope: dict[str, Any], hf_config: Any) -> dict[str, Any]:
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type") in ("yarn", "longrope"):
        # Their default factor and pretraining length derive from the context length.
        scaling.setdefault("max_position_embeddings", hf_config.max_position_embeddings)
    return scaling
