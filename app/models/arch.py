"""ArchConfig: the few numbers our Llama-family model needs, read once from an HF config."""

from dataclasses import dataclass, field
from typing import Any

from app.protocol.errors import ModelLoadError

# HF architecture name -> whether q/k/v projections carry a bias.
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,  # Llama 2/3, SmolLM2, TinyLlama, ...
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf_config: Any, model_name: str) -> "ArchConfig":
        archs = list(getattr(hf_config, "architectures", None) or [])
        if not archs and getattr(hf_config, "model_type", None) == "llama":
            archs = ["LlamaForCausalLM"]  # GGUF configs may omit `architectures`
        supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not supported:
            raise ModelLoadError(
                model_name,
                f"unsupported architecture {archs or getattr(hf_config, 'model_type', '?')}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
            )
        arch = supported[0]
        rope = _rope_parameters(hf_config)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(model_name, f"unsupported RoPE scaling type {rope_type!r}")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        qkv_bias = SUPPORTED_ARCHITECTURES[arch] or bool(
            getattr(hf_config, "attention_bias", False)
        )
        max_pos = hf_config.max_position_embeddings
        window = getattr(hf_config, "sliding_window", None)
        if arch == "MistralForCausalLM" and window:
            # Without sliding-window attention we stay exact by never exceeding the window.
            max_pos = min(max_pos, window)
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
            eos_token_ids=eos_ids,
        )


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    """transformers >= 5 keeps RoPE settings in `rope_parameters`; older ones split them."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params
