"""llama.cpp's projector files (`mmproj-*.gguf`): the image encoder of a GGUF model,
beside it, as llama.cpp's converter writes it (`clip.*` metadata, `v.*` and `mm.*`
tensors). Read into the same encoder modules as the safetensors checkpoints, under their
names, with the converter's edits undone (Gemma 3's projector norm is stored as 1 + w).
Served projector types: gemma3, idefics3 (SmolVLM) and Qwen2.5-VL's (mmproj_qwen.py)."""

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from app.models.vision import mmproj_qwen
from app.protocol.errors import ModelLoadError

_SIGLIP = {  # llama.cpp's name (its {i} the layer) -> ours under the tower's vision_model
    "v.patch_embd": "embeddings.patch_embedding",
    "v.position_embd": "embeddings.position_embedding",
    "v.post_ln": "post_layernorm",
    "v.blk.{i}.attn_q": "encoder.layers.{i}.self_attn.q_proj",
    "v.blk.{i}.attn_k": "encoder.layers.{i}.self_attn.k_proj",
    "v.blk.{i}.attn_v": "encoder.layers.{i}.self_attn.v_proj",
    "v.blk.{i}.attn_out": "encoder.layers.{i}.self_attn.out_proj",
    "v.blk.{i}.ln1": "encoder.layers.{i}.layer_norm1",
    "v.blk.{i}.ln2": "encoder.layers.{i}.layer_norm2",
    "v.blk.{i}.ffn_up": "encoder.layers.{i}.mlp.fc1",
    "v.blk.{i}.ffn_down": "encoder.layers.{i}.mlp.fc2",
}
_PROJECTORS = {  # projector type -> its SigLIP's place, its own tensors, its image token
    "gemma3": (
        "vision_tower.vision_model.",
        {
            "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
            "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
        },
        "<image_soft_token>",
    ),
    "idefics3": (
        "vision_model.",
        {"mm.model.fc.weight": "connector.modality_projection.proj.weight"},
        "<image>",
    ),
}
SERVED = (*_PROJECTORS, mmproj_qwen.KIND)
GEMMA3_SCALE = 4  # patches per side pooled into one token's, unless the file says


def read_mmproj(path: str | Path, model: str) -> tuple[str, dict[str, Any], Any]:
    """(projector type, `clip.*` metadata, the gguf reader) of a projector file."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        meta = {n: f.contents() for n, f in reader.fields.items() if n.startswith("clip.")}
    except (OSError, ValueError, IndexError, KeyError) as exc:
        raise ModelLoadError(model, f"cannot read the projector file {path}: {exc!r}") from exc
    kind = meta.get("clip.projector_type") or meta.get("clip.vision.projector_type")
    if kind not in SERVED:
        served = ", ".join(SERVED)
        raise ModelLoadError(model, f"projector type {kind!r} is not served (served: {served})")
    return kind, meta, reader


def image_token(kind: str) -> str:
    """The token whose places take the encoder's rows, as the model's vocabulary has it."""
    return mmproj_qwen.IMAGE_TOKEN if kind == mmproj_qwen.KIND else _PROJECTORS[kind][2]


def model_config(kind: str, meta: dict[str, Any], image_token_id: int, model: str = "") -> Any:
    """The multimodal config the encoder of `kind` reads, from the file's metadata."""
    try:
        if kind == mmproj_qwen.KIND:
            return mmproj_qwen.config(meta, image_token_id)
        return _config(kind, meta, image_token_id)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(model, f"a {kind} projector file without {exc}") from None


def _config(kind: str, meta: dict[str, Any], image_token_id: int) -> Any:
    v = "clip.vision."
    size, patch = int(meta[v + "image_size"]), int(meta[v + "patch_size"])
    default = GEMMA3_SCALE if kind == "gemma3" else 2
    scale = int(meta.get(v + "projector.scale_factor") or default)
    vision = SimpleNamespace(
        hidden_size=int(meta[v + "embedding_length"]),
        intermediate_size=int(meta[v + "feed_forward_length"]),
        num_hidden_layers=int(meta[v + "block_count"]),
        num_attention_heads=int(meta[v + "attention.head_count"]),
        layer_norm_eps=float(meta.get(v + "attention.layer_norm_epsilon", 1e-6)),
        image_size=size,
        patch_size=patch,
        num_channels=3,
        hidden_act="gelu_pytorch_tanh",
    )
    return SimpleNamespace(
        vision_config=vision,
        text_config=SimpleNamespace(hidden_size=int(meta[v + "projection_dim"])),
        mm_tokens_per_image=(size // patch // scale) ** 2,  # Gemma 3's
        scale_factor=scale,  # Idefics3's
        image_token_id=image_token_id,
    )


def state_of(kind: str, reader: Any, model: str) -> dict[str, torch.Tensor]:
    """The file's tensors under the names of the encoder of `kind`."""
    if kind == mmproj_qwen.KIND:
        return mmproj_qwen.state_of({t.name: dequantized(t) for t in reader.tensors}, model)
    tower, own, _ = _PROJECTORS[kind]
    state = {}
    for tensor in reader.tensors:
        base, _, part = tensor.name.rpartition(".")
        ours = own.get(tensor.name)
        if ours is None:
            layer = re.search(r"\.(\d+)\.", base)
            key = base.replace(f".{layer.group(1)}.", ".{i}.") if layer else base
            if key not in _SIGLIP:
                raise ModelLoadError(model, f"unknown tensor {tensor.name} in a {kind} projector")
            name = _SIGLIP[key].format(i=layer.group(1) if layer else "")
            ours = f"{tower}{name}.{part}"
        weights = dequantized(tensor)
        if tensor.name == "mm.soft_emb_norm.weight":
            weights = weights - 1.0  # stored as 1 + w; the projector adds the 1
        state[ours] = weights
    return state


def dequantized(tensor: Any) -> torch.Tensor:
    """A projector tensor in float32, whatever type the file keeps it in."""
    import gguf

    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))


def special_token_id(source_path: Path, token: str, model: str) -> int:
    """A token's id in a GGUF model's vocabulary (its `tokenizer.ggml.tokens`)."""
    import gguf

    tokens = gguf.GGUFReader(str(source_path)).fields.get("tokenizer.ggml.tokens")
    found = list(tokens.contents()) if tokens is not None else []
    if token not in found:
        raise ModelLoadError(model, f"the model's vocabulary has no {token}: not its projector")
    return found.index(token)
