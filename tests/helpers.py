"""Builders shared by the tests: tiny random checkpoints and engines over them."""

from pathlib import Path
from typing import Any

import torch

from app.engine import EngineConfig, LLMEngine

TINY_VOCAB = 256
TINY_EOS = 255


def save_tiny_checkpoint(
    directory: Path,
    architecture: str = "llama",
    max_shard_size: str | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a random HF checkpoint (config.json + safetensors) of a tiny model."""
    import transformers

    kinds = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = kinds[architecture]
    settings: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=TINY_EOS,
        bos_token_id=0,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def tiny_engine(checkpoint: Path, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = dict(
        model=str(checkpoint), dtype="float32", num_kv_blocks=64, block_size=4, num_threads=2
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))
