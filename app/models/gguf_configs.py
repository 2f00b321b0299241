"""Configs of GGUF architectures that transformers' GGUF reader lacks, added to its table
of config builders (`transformers.integrations.gguf.GGUF_CONFIG_ARCHS`: one function per
llama.cpp architecture, from the file's metadata), which AutoConfig and AutoTokenizer
both consult for a `gguf_file`. Added: qwen2vl, the language model of Qwen2-VL and
Qwen2.5-VL (Qwen2 with q/k/v biases and 3-D rotary positions); its image encoder is the
projector file beside it (app/models/vision/mmproj.py)."""

from typing import Any


def qwen2vl_config(metadata: dict[str, Any], tensor_names: tuple[str, ...]) -> dict[str, Any]:
    key = lambda name: metadata[f"qwen2vl.{name}"]  # noqa: E731
    sections = [int(n) for n in key("rope.dimension_sections") if n]  # padded to four
    return {
        "model_type": "qwen2_5_vl_text",
        # what app.models.families reads the layout by; the file has no vision tower
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "max_position_embeddings": key("context_length"),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": key("rope.freq_base"),
            "mrope_section": sections,
        },
        "vocab_size": _count(metadata["tokenizer.ggml.tokens"]),
        # llama.cpp writes the output projection only when it is not the embedding's
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }


def _count(tokens: Any) -> int:
    # transformers' metadata reader leaves the vocabulary as its length, unless asked
    return tokens if isinstance(tokens, int) else len(tokens)


ADDED = {"qwen2vl": qwen2vl_config}


def add_gguf_configs() -> None:
    """Put ADDED into transformers' table (idempotent; its own entries win)."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS

    for arch, builder in ADDED.items():
        GGUF_CONFIG_ARCHS.setdefault(arch, builder)
