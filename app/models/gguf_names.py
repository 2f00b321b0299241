"""llama.cpp's GGUF names, mapped back to HF's: tensor names (gguf-py's TENSOR_NAMES, as
convert_hf_to_gguf.py writes them) and the metadata transformers' GGUF config reader
loses on the way to a config.

Tensors come back under HF names so each family's `rename` applies as for safetensors
(Phi-3's fused attn_qkv/ffn_up stay fused, as in HF). Experts are stacked in one (E, ...)
tensor per layer in GGUF; `hf_name` gives the per-expert name with an `{expert}` field.
"""

from typing import Any

from app.protocol.errors import ModelLoadError

GLOBALS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Never loaded as weights: Phi-3's LongRoPE factors go into the config (see _phi3), and
# so do Llama 3.1+'s per-frequency RoPE divisors in rope_freqs (see _rope_divisors).
IGNORED = {"rope_freqs", "rope_factors_long", "rope_factors_short"}
LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",  # the norm before the MLP (Gemma: see below)
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3, fused as in HF
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
ARCH_PARTS = {
    # Gemma norms both sides of each sublayer: HF's post_attention_layernorm is the one
    # after attention, and llama.cpp's ffn_norm the one before the MLP.
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    # Phi-3's ffn_up is HF's gate_up_proj as is: gate rows first, as llama.cpp's swiglu
    # splits it.
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
EXPERT_PARTS = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


def hf_name(name: str, arch: str) -> str | None:
    """The HF name of GGUF tensor `name` in a file of llama.cpp architecture `arch`
    (experts: with an `{expert}` field); None for tensors recomputed from the config.
    Raises KeyError for a tensor we do not know, rather than load a model without it."""
    base, _, kind = name.rpartition(".")  # kind: weight | bias
    if base in IGNORED:
        return None
    if base in GLOBALS:
        return f"{GLOBALS[base]}.{kind}"
    parts = base.split(".")
    if len(parts) < 3 or parts[0] != "blk":
        raise KeyError(name)
    layer, part = f"model.layers.{parts[1]}", parts[2]
    if len(parts) == 3 and part.endswith("_exps") and part[:-5] in EXPERT_PARTS:
        return f"{layer}.mlp.experts.{{expert}}.{EXPERT_PARTS[part[:-5]]}.{kind}"
    if len(parts) == 4 and parts[3].isdigit() and part in EXPERT_PARTS:
        # Mixtral files from before llama.cpp stacked experts: blk.N.ffn_gate.E
        return f"{layer}.mlp.experts.{parts[3]}.{EXPERT_PARTS[part]}.{kind}"
    table = {**LAYER_PARTS, **ARCH_PARTS.get(arch, {})}
    if len(parts) != 3 or part not in table:
        raise KeyError(name)
    return f"{layer}.{table[part]}.{kind}"


def patch_config(hf_config: Any, reader: Any, model_name: str) -> Any:
    """Put back into transformers' config of a GGUF file (`reader`: its gguf.GGUFReader)
    what its reader drops or leaves at the config class's defaults, from the metadata
    llama.cpp wrote, so that read_arch_config sees the model llama.cpp would run."""
    meta = _Metadata(reader)
    c = hf_config
    c.rms_norm_eps = meta.number("attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    if (key_length := meta.get("attention.key_length")) is not None:
        c.head_dim = key_length  # Qwen3's config class defaults to 128
    rope = {"rope_type": "default", "rope_theta": meta.number("rope.freq_base", 10000.0)}
    rope.update(_rope_scaling(meta))
    rope.update(_rope_divisors(meta))
    if meta.arch == "llama":
        _llama(c, meta)
    elif meta.arch in ("qwen2moe", "qwen3moe"):
        _qwen_moe(c, meta)
    elif meta.arch in ("gemma2", "gemma3"):
        rope = _gemma(c, meta, rope)
    elif meta.arch == "phi3":
        rope = _phi3(c, meta, rope, model_name)
    elif meta.arch == "qwen2vl":  # 3-D rotary positions: the sections, padded to four
        rope["mrope_section"] = [int(n) for n in meta.get("rope.dimension_sections") if n]
    c.rope_parameters = rope
    c.eos_token_id = _end_tokens(c.eos_token_id, reader)
    return c


def _end_tokens(eos: Any, reader: Any) -> list[int] | int | None:
    """EOS plus llama.cpp's end-of-turn and end-of-message ids: instruction-tuned Gemma
    files end a turn with <end_of_turn> (eot) while their eos stays <eos>."""
    ids = [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [eos]
    for key in ("eos", "eot", "eom"):
        field = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None and int(field.contents()) not in ids:
            ids.append(int(field.contents()))
    return ids[0] if len(ids) == 1 else (ids or None)


class _Metadata:
    def __init__(self, reader: Any):
        self.reader = reader
        self.arch = reader.fields["general.architecture"].contents()
        self.tensors = {t.name: t for t in reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(f"{self.arch}.{key}")
        return default if field is None else field.contents()

    def number(self, key: str, default: Any = None) -> Any:
        value = self.get(key)
        return default if value is None else _decimal(value)


def _decimal(value: Any) -> float:
    # GGUF holds float32: read it back as the shortest decimal that float32 rounds to it
    # (1e-06, not 9.99999997e-07), the value the converter was given.
    import numpy as np

    return float(str(np.float32(value)))


def _rope_scaling(meta: _Metadata) -> dict[str, Any]:
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta.number("rope.scaling.factor")}
    return {"rope_type": kind}  # e.g. yarn: the families name it as unsupported


def _rope_divisors(meta: _Metadata) -> dict[str, Any]:
    """llama.cpp writes Llama 3.1+'s RoPE scaling only as the tensor `rope_freqs`: one
    divisor per frequency (its converter's rendering of rope_type llama3). transformers'
    reader drops it, which would serve those models with unscaled RoPE."""
    tensor = meta.tensors.get("rope_freqs.weight")
    if tensor is None:
        return {}
    return {"rope_type": "divisors", "divisors": [float(x) for x in tensor.data.reshape(-1)]}


def _llama(c: Any, meta: _Metadata) -> None:
    # llama.cpp's llama architecture has no sliding window: Mistral's config class
    # would otherwise apply its default 4096.
    c.sliding_window = None
    if experts := meta.get("expert_count"):  # Mixtral is a llama file with experts
        c.architectures = ["MixtralForCausalLM"]
        c.num_local_experts = experts
        c.num_experts_per_tok = meta.get("expert_used_count")


def _qwen_moe(c: Any, meta: _Metadata) -> None:
    # Sizes from the metadata, else from the tensors themselves (older files).
    c.moe_intermediate_size = meta.get("expert_feed_forward_length") or _rows(
        meta, "blk.0.ffn_gate_exps.weight", 1
    )
    shared = meta.get("expert_shared_feed_forward_length")
    c.shared_expert_intermediate_size = shared or _rows(meta, "blk.0.ffn_gate_shexp.weight", 0)
    # llama.cpp normalises the top-k weights of Qwen3-MoE, not of Qwen2-MoE
    c.norm_topk_prob = bool(meta.get("expert_weights_norm", meta.arch == "qwen3moe"))
    c.mlp_only_layers, c.decoder_sparse_step = [], 1  # every layer routed, as in llama.cpp


def _rows(meta: _Metadata, tensor: str, dim: int) -> int:
    return int(meta.tensors[tensor].data.shape[dim]) if tensor in meta.tensors else 0


def _gemma(c: Any, meta: _Metadata, rope: dict[str, Any]) -> dict[str, Any]:
    gemma3 = meta.arch == "gemma3"
    # llama.cpp scales queries by head_dim ** -0.5, but by (hidden / heads) ** -0.5 for
    # the 27B models (46 Gemma 2 layers, 62 Gemma 3): HF's query_pre_attn_scalar.
    big = c.num_hidden_layers == (62 if gemma3 else 46)
    c.query_pre_attn_scalar = c.hidden_size // c.num_attention_heads if big else c.head_dim
    if gemma3:
        c.attn_logit_softcapping = None
        c.final_logit_softcapping = meta.number("final_logit_softcapping")
    else:  # absent: llama.cpp's defaults, which are Gemma2Config's too
        c.attn_logit_softcapping = meta.number("attn_logit_softcapping", 50.0)
        c.final_logit_softcapping = meta.number("final_logit_softcapping", 30.0)
    c.layer_types = _layer_types(meta, c.num_hidden_layers, 6 if gemma3 else 2)
    if not gemma3:
        return rope
    # llama.cpp's Gemma 3 runs its sliding layers at base 10000 unless the file says
    local = {"rope_type": "default", "rope_theta": meta.number("rope.freq_base_swa", 10000.0)}
    return {"full_attention": rope, "sliding_attention": local}


def _layer_types(meta: _Metadata, layers: int, period: int) -> list[str]:
    pattern = meta.get("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):  # one flag per layer: True = sliding
        sliding = [bool(p) for p in pattern]
    else:  # every `pattern`-th layer global, as llama.cpp's set_swa_pattern
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _phi3(c: Any, meta: _Metadata, rope: dict[str, Any], model_name: str) -> dict[str, Any]:
    head_dim = c.hidden_size // c.num_attention_heads
    rotary = meta.get("rope.dimension_count", head_dim)
    c.partial_rotary_factor = rope["partial_rotary_factor"] = rotary / head_dim
    c.sliding_window = meta.get("attention.sliding_window") or None
    if "rope_factors_long.weight" not in meta.tensors:
        return rope
    # LongRoPE: llama.cpp keeps the factors as tensors and names no scaling type
    original = meta.get("rope.scaling.original_context_length")
    if original is None or "rope_factors_short.weight" not in meta.tensors:
        raise ModelLoadError(
            model_name, "LongRoPE factors without rope.scaling.original_context_length"
        )
    c.original_max_position_embeddings = original
    factors = {
        key: [_decimal(x) for x in meta.tensors[f"rope_factors_{kind}.weight"].data]
        for key, kind in (("long_factor", "long"), ("short_factor", "short"))
    }
    return {
        **rope,
        **factors,
        "rope_type": "longrope",
        "original_max_position_embeddings": original,
    }
