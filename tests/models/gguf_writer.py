"""Tiny HF checkpoints as GGUF files, written the way llama.cpp's convert_hf_to_gguf.py
writes them (float32): its tensor names (gguf-py's own name map), its metadata keys and
its tensor edits (Llama's q/k row permutation, Gemma's norms stored as 1 + w, experts
stacked into one (E, ...) tensor per layer, Phi-3's fused projections as they are and
its LongRoPE factors as tensors). Tests only: what the GGUF loader must undo."""

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tests.helpers import TINY_EOS
from tests.models.k_quants import quantize_q4_k, quantize_q5_k

# HF architecture -> llama.cpp's (Mistral and Mixtral are "llama" files)
_ARCHS = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
    "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
    "Qwen2MoeForCausalLM": gguf.MODEL_ARCH.QWEN2MOE,
    "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
    # the language model only: the image encoder goes to the projector (mmproj_writer.py)
    "Qwen2_5_VLForConditionalGeneration": gguf.MODEL_ARCH.QWEN2VL,
}
_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def write_gguf(
    checkpoint: Path,
    path: Path,
    extra: dict[str, Any] | None = None,
    qtype: "gguf.GGMLQuantizationType | None" = None,
    expert_qtype: "gguf.GGMLQuantizationType | None" = None,
    tokens: list[str] | None = None,
    tokenizer: Path | None = None,
) -> Path:
    """Convert the checkpoint in `checkpoint` (config.json + model.safetensors) to `path`;
    `extra`: more tensors (GGUF name -> numpy array) written as they are; `qtype`: weight
    matrices quantized to that type (norms and MoE routers stay float32, as llama-quantize
    leaves them), `expert_qtype`: the stacked experts (else float32); `tokens`: the
    vocabulary's strings (else placeholders); `tokenizer`: the directory of a byte-level
    BPE tokenizer written whole instead, merges and chat template too."""
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    config = {**config, **config.get("text_config", {})}  # a multimodal checkpoint's
    arch = _ARCHS[config["architectures"][0]]
    _check_representable(arch, config)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(checkpoint.name)
    _metadata(writer, arch, config)
    if tokenizer is not None:
        _bpe_vocab(writer, config, tokenizer)
    else:
        _vocab(writer, config, tokens)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    tensors = _language_model(load_file(str(checkpoint / "model.safetensors")))
    for name, tensor in _converted(arch, config, tensors):
        base, _, kind = name.rpartition(".")
        gguf_name = names.get_name(base)
        if gguf_name is None:  # llama.cpp's converter refuses such a checkpoint too
            raise ValueError(f"llama.cpp has no name for {name} in a {arch.name} file")
        array = tensor.float().contiguous().numpy()
        chosen = expert_qtype if array.ndim == 3 else qtype
        if gguf_name.endswith("ffn_gate_inp"):
            chosen = None  # the router: llama-quantize keeps it float32 too
        if chosen is not None and array.ndim >= 2 and array.shape[-1] % _block(chosen) == 0:
            raw = quantize(array, chosen)
            writer.add_tensor(f"{gguf_name}.{kind}", raw, raw_dtype=chosen)
        else:
            writer.add_tensor(f"{gguf_name}.{kind}", array)
    for name, array in [*_rope_factor_tensors(arch, config), *(extra or {}).items()]:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantize(array: np.ndarray, qtype: "gguf.GGMLQuantizationType") -> np.ndarray:
    """Rows of `array` in GGML type `qtype` (gguf-py's quantizers; ours for Q4_K, Q5_K)."""
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(array)
    if qtype == gguf.GGMLQuantizationType.Q5_K:
        return quantize_q5_k(array)
    return gguf.quants.quantize(array, qtype)


def _block(qtype: "gguf.GGMLQuantizationType") -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


def _rope(config: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        return rope.get(layer_type) or {}
    return rope if layer_type == "full_attention" else {}


def _metadata(w: gguf.GGUFWriter, arch: gguf.MODEL_ARCH, c: dict[str, Any]) -> None:
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c.get("num_key_value_heads") or c["num_attention_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    full, local = _rope(c), _rope(c, "sliding_attention")
    w.add_rope_freq_base(full.get("rope_theta", 10000.0))
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if "rope_theta" in local:  # Gemma 3's sliding layers
        w.add_rope_freq_base_swa(local["rope_theta"])
    if arch != gguf.MODEL_ARCH.PHI3 and c.get("head_dim"):
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    if experts := c.get("num_local_experts") or c.get("num_experts"):
        w.add_expert_count(experts)
        w.add_expert_used_count(c["num_experts_per_tok"])
    if c.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if c.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if sections := full.get("mrope_section"):
        w.add_rope_dimension_sections([*sections, 0, 0, 0, 0][:4])
    if arch == gguf.MODEL_ARCH.LLAMA:
        w.add_vocab_size(c["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    elif arch == gguf.MODEL_ARCH.GEMMA2:
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])
    elif arch == gguf.MODEL_ARCH.GEMMA3:
        if c.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(c["sliding_window"])
    elif arch == gguf.MODEL_ARCH.PHI3:
        partial = full.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        original = full.get("original_max_position_embeddings")
        w.add_rope_scaling_orig_ctx_len(original or c["original_max_position_embeddings"])
        w.add_rope_dimension_count(int(partial * c["hidden_size"]) // c["num_attention_heads"])
        w.add_sliding_window(c.get("sliding_window") or 0)
        if full.get("rope_type") == "longrope":
            original = original or c["original_max_position_embeddings"]
            scale = c["max_position_embeddings"] / original
            factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            w.add_rope_scaling_attn_factors(factor)


def _check_representable(arch: gguf.MODEL_ARCH, c: dict[str, Any]) -> None:
    """Refuse what a llama.cpp file cannot say: its Gemma loaders fix the sliding-layer
    pattern (every 2nd layer global for Gemma 2, every 6th for Gemma 3) and derive the
    query scale from the head size."""
    if arch not in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3):
        return
    period = 2 if arch == gguf.MODEL_ARCH.GEMMA2 else 6
    expected = [
        "sliding_attention" if (i + 1) % period else "full_attention"
        for i in range(c["num_hidden_layers"])
    ]
    if c.get("layer_types") not in (None, expected):
        raise ValueError(f"llama.cpp's {arch.name} runs layer types {expected}")
    if c["query_pre_attn_scalar"] != c["head_dim"]:
        raise ValueError("llama.cpp scales Gemma queries by head_dim ** -0.5")


def _vocab(w: gguf.GGUFWriter, c: dict[str, Any], tokens: list[str] | None = None) -> None:
    """The vocabulary's strings, or placeholders: transformers sizes the config from it
    when no key says so."""
    size = c["vocab_size"]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens or [f"<t{i}>" for i in range(size)])
    w.add_token_scores([0.0] * size)
    w.add_token_types([gguf.TokenType.NORMAL] * size)
    w.add_bos_token_id(c.get("bos_token_id") or 0)
    w.add_eos_token_id(c.get("eos_token_id", TINY_EOS))


def _bpe_vocab(w: gguf.GGUFWriter, c: dict[str, Any], directory: Path) -> None:
    """A byte-level BPE vocabulary as the converter's `_set_vocab_gpt2` writes it: added
    tokens are control tokens (special) or user-defined, the merges and special ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(c["vocab_size"]):
        token = by_id.get(i, f"[PAD{i}]")
        tokens.append(token)
        if i not in by_id:
            types.append(gguf.TokenType.UNUSED)
        elif token in added:
            special = decoder[i].special
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")  # what the converter recognises SmolLM2's vocabulary as
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(directory, load_merges=True).add_to_gguf(w)


def _language_model(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A multimodal checkpoint's language model under a causal LM's names; else as is."""
    out = {}
    for name, tensor in tensors.items():
        if name.startswith(("visual.", "model.visual.")):
            continue
        out[name.replace("model.language_model.", "model.", 1)] = tensor
    return out


def _converted(arch: gguf.MODEL_ARCH, c: dict[str, Any], tensors: dict[str, torch.Tensor]):
    """(HF-style name, tensor) after llama.cpp's edits; experts come stacked per layer."""
    stacks: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        if arch == gguf.MODEL_ARCH.LLAMA:
            tensor = _permute_qk(name, tensor, c)
        if arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3):
            if name == "lm_head.weight":
                continue  # llama.cpp drops it: Gemma ties the output to the embedding
            if name.endswith("norm.weight"):
                tensor = tensor + 1  # Gemma's RMSNorm scales by 1 + w; llama.cpp's by w
        parts = name.split(".")
        if "experts" in parts and parts[-2] in _EXPERT_PARTS:
            i = parts.index("experts")
            stacked = ".".join(parts[: i + 1] + parts[i + 2 :])  # drop the expert index
            stacks.setdefault(stacked, []).append((int(parts[i + 1]), tensor))
            continue
        yield name, tensor
    for name, experts in stacks.items():
        yield name, torch.stack([t for _, t in sorted(experts, key=lambda e: e[0])])


def _permute_qk(name: str, tensor: torch.Tensor, c: dict[str, Any]) -> torch.Tensor:
    # llama.cpp's LlamaModel.permute: rotate-half pairs become interleaved pairs
    heads = c["num_attention_heads"]
    if ".k_proj." in name:
        heads = c.get("num_key_value_heads") or heads
    elif ".q_proj." not in name:
        return tensor
    shape = tensor.shape
    return (
        tensor.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def _rope_factor_tensors(arch: gguf.MODEL_ARCH, c: dict[str, Any]):
    rope = _rope(c)
    if rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", _llama3_divisors(c, rope)
        return
    if arch != gguf.MODEL_ARCH.PHI3 or rope.get("rope_type") != "longrope":
        return
    yield "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
    yield "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)


def _llama3_divisors(c: dict[str, Any], rope: dict[str, Any]) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors: llama3 scaling as one divisor per
    frequency (1 for short wavelengths, `factor` for long ones, smoothed between)."""
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    base, factor = rope.get("rope_theta", 10000.0), rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)
