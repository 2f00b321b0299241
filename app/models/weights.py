"""Tensor iterators over checkpoints: HF safetensors (sharded or not) and GGUF."""

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from app.models.arch import ArchConfig
from app.models.source import ModelSource
from app.protocol.errors import ModelLoadError

_GGUF_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBALS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def iter_weights(source: ModelSource, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from app.models.families import hf_tensors

    if source.is_gguf:
        return hf_tensors(iter_gguf(source, arch), arch, norm_offset=False)
    return hf_tensors(iter_safetensors(source), arch)


def safetensors_files(source: ModelSource) -> list[Path]:
    index = source.directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(source.name, f"corrupt index {index.name}: {exc}") from exc
        files = [source.directory / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(source.directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(source.name, f"no *.safetensors files in {source.directory}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(source.name, f"missing weight files: {', '.join(missing)}")
    return files


def iter_safetensors(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(source):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(source.name, f"corrupt weights in {path.name}: {exc}") from exc


def iter_gguf(source: ModelSource, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    path = source.directory / str(source.gguf_file)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises bare ValueErrors/struct errors on bad files
        raise ModelLoadError(source.name, f"corrupt GGUF file {path.name}: {exc}") from exc
    # llama.cpp stores q/k rows permuted for its interleaved RoPE; Qwen2 files are not.
    permuted = arch.architecture in ("LlamaForCausalLM", "MistralForCausalLM")
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name)
        if name is None:
            continue
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ModelLoadError(source.name, f"cannot decode tensor {tensor.name}: {exc}") from exc
        weights = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
        if permuted and ".q_proj." in name:
            weights = _unpermute(weights, arch.num_heads)
        elif permuted and ".k_proj." in name:
            weights = _unpermute(weights, arch.num_kv_heads)
        yield name, weights


def gguf_to_hf_name(name: str) -> str | None:
    base, _, kind = name.rpartition(".")  # kind: weight | bias
    if base in _GGUF_GLOBALS:
        return f"{_GGUF_GLOBALS[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_PARTS:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_PARTS[parts[2]]}.{kind}"
    return None  # e.g. rope_freqs: recomputed from the config


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # Inverse of llama.cpp's convert permute: (nh, 2, hd/2, ...) <- (nh, hd/2, 2, ...)
    shape = w.shape
    return (
        w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)
    )
