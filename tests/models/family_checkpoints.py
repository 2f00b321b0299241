"""Tiny random checkpoints of every supported family, in the real models' shapes
(GQA, q/k norms, sliding windows smaller than the test prompts, experts), for the
token-for-token comparisons with transformers. Also used by bench/offline_throughput.py."""

from pathlib import Path
from typing import Any

import torch

from tests.helpers import TINY_EOS, TINY_VOCAB

WINDOW = 8  # smaller than every test prompt, and not a multiple of the block size (4)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": 128,  # past every test sequence: short factors
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0],
}
_COMMON: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=TINY_EOS,
    bos_token_id=0,
    pad_token_id=0,
    tie_word_embeddings=False,
    initializer_range=0.2,  # spread-out logits: greedy choices are not near-ties
)
# family -> (transformers config class, model class, settings of the real shape)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "qwen3-yarn": (  # Qwen3's long-context setting, with a short pretraining length
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            head_dim=16,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=3,  # sliding, global, sliding
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0,  # low enough that capping changes the scores
            final_logit_softcapping=3.0,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            rope_parameters={
                "full_attention": {
                    "rope_type": "linear",
                    "factor": 8.0,
                    "rope_theta": 1000000.0,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            tie_word_embeddings=True,
        ),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict()),
    "phi4-mini": (  # partial RoPE and LongRoPE
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            partial_rotary_factor=0.75,
            rope_parameters={**LONGROPE, "partial_rotary_factor": 0.75},
            max_position_embeddings=256,
            tie_word_embeddings=True,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_hidden_layers=3,
            mlp_only_layers=[1],  # a dense layer between sparse ones
        ),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
}


def save_family_checkpoint(directory: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    import transformers

    config_name, model_name, settings = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_COMMON, **settings, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    model.save_pretrained(directory)
    return directory


def save_gemma3_multimodal(directory: Path, seed: int = 0) -> Path:
    """gemma-3-4b-it's layout: a language model inside a vision-language checkpoint."""
    import transformers

    _, _, text = FAMILIES["gemma3"]
    text_config = {**_COMMON, **text, "vocab_size": TINY_VOCAB + 4}
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text_config,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=TINY_VOCAB,
        eoi_token_index=TINY_VOCAB + 1,
        image_token_index=TINY_VOCAB + 2,
        eos_token_id=[TINY_EOS, TINY_VOCAB + 3],  # gemma-3-4b-it: [<eos>, <end_of_turn>]
    )
    torch.manual_seed(seed)
    transformers.Gemma3ForConditionalGeneration(config).eval().save_pretrained(directory)
    return directory
