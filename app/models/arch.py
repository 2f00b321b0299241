"""ArchConfig: the numbers and switches our decoder needs, read once from an HF config.

Every supported family is the same pre-norm decoder with a few switches (q/k norms,
Gemma's sandwich norms and soft-capping, sliding windows, routed experts); each
family's module in app/models/families reads its config into these fields.
"""

from dataclasses import dataclass, field
from typing import Any

# "divisors": per-frequency divisors given outright (what GGUF files carry for llama3)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "divisors", "mrope")


@dataclass(frozen=True)
class MoEConfig:
    """Top-k routed experts (Mixtral, Qwen2/3-MoE), optionally with a gated shared expert."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    normalize_top_k: bool  # renormalise the k chosen probabilities to sum to 1
    shared_intermediate_size: int = 0  # 0: no shared expert
    sparse_layers: tuple[bool, ...] = ()  # per layer: experts (True) or a dense MLP
    float32_weights: bool = False  # Mixtral weighs expert outputs in float32, then rounds


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
    # ---- family switches (defaults: Llama) -------------------------------------------
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and around the MLP too (Gemma 2/3)
    norm_weight_offset: float = 0.0  # Gemma scales by (1 + w): the offset is folded in at load
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(hidden_size)
    hidden_act: str = "silu"  # "silu" | "gelu_tanh"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float = 0.0  # Gemma 2: scores = cap * tanh(scores / cap)
    final_softcap: float = 0.0  # Gemma 2: the same on the logits
    layer_windows: tuple[int, ...] = ()  # per layer sliding window (0: global); () all global
    local_rope_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers
    rotary_dim: int | None = None  # partial rotary (Phi-4-mini); None: the whole head
    moe: MoEConfig | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and (
            not self.moe.sparse_layers or self.moe.sparse_layers[layer]
        )
