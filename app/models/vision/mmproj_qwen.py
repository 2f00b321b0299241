"""Qwen2.5-VL's projector file (`qwen2.5vl_merger`), read into the checkpoint's encoder
(qwen2_5_vl.py) under its names, with llama.cpp's converter's edits undone: the 3-D
patch embedding split into one 2-D kernel per frame (`v.patch_embd.weight` and
`.weight.1`), each block's qkv split into q, k and v. The file leaves out what
llama.cpp fixes: the 2 x 2 merge (unless `spatial_merge_size` says), two frames a patch,
windows of 112 pixels (unless `window_size` says); the full-attention layers are every
`n_wa_pattern`-th."""

import re
from types import SimpleNamespace
from typing import Any

import torch

from app.protocol.errors import ModelLoadError

KIND = "qwen2.5vl_merger"
IMAGE_TOKEN = "<|image_pad|>"
_BLOCK = {  # llama.cpp's part of v.blk.{i} -> ours under visual.blocks.{i}
    "attn_out": "attn.proj",
    "ln1": "norm1",
    "ln2": "norm2",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_OTHERS = {
    "v.post_ln": "visual.merger.ln_q",
    "mm.0": "visual.merger.mlp.0",
    "mm.2": "visual.merger.mlp.2",
}
_QKV = ("attn_q", "attn_k", "attn_v")


def config(meta: dict[str, Any], image_token_id: int) -> Any:
    v = "clip.vision."
    layers, pattern = int(meta[v + "block_count"]), int(meta[v + "n_wa_pattern"])
    # 0: no window attention (every layer full), as llama.cpp reads it
    full = [i for i in range(layers) if pattern == 0 or (i + 1) % pattern == 0]
    vision = SimpleNamespace(
        hidden_size=int(meta[v + "embedding_length"]),
        intermediate_size=int(meta[v + "feed_forward_length"]),
        depth=layers,
        num_heads=int(meta[v + "attention.head_count"]),
        out_hidden_size=int(meta[v + "projection_dim"]),
        patch_size=int(meta[v + "patch_size"]),
        spatial_merge_size=int(meta.get(v + "spatial_merge_size") or 2),
        temporal_patch_size=2,
        in_channels=3,
        window_size=int(meta.get(v + "window_size") or 112),
        fullatt_block_indexes=full,
        rope_parameters=None,
    )
    return SimpleNamespace(
        vision_config=vision,
        text_config=SimpleNamespace(hidden_size=vision.out_hidden_size),
        image_token_id=image_token_id,
    )


def state_of(tensors: dict[str, torch.Tensor], model: str) -> dict[str, torch.Tensor]:
    """The file's tensors (by llama.cpp's names, in float32) under the names of
    Qwen2.5-VL's encoder."""
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}  # what is put back together
    for name, weights in tensors.items():
        if name.startswith("v.patch_embd.weight"):
            parts.setdefault("visual.patch_embed.proj.weight", {})[name] = weights
            continue
        base, _, kind = name.rpartition(".")
        block = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)", base)
        if block and block.group(2) in _QKV:
            ours = f"visual.blocks.{block.group(1)}.attn.qkv.{kind}"
            parts.setdefault(ours, {})[block.group(2)] = weights
        elif block and block.group(2) in _BLOCK:
            state[f"visual.blocks.{block.group(1)}.{_BLOCK[block.group(2)]}.{kind}"] = weights
        elif base in _OTHERS:
            state[f"{_OTHERS[base]}.{kind}"] = weights
        else:
            raise ModelLoadError(model, f"unknown tensor {name} in a {KIND} projector")
    for ours, found in parts.items():
        order = ("v.patch_embd.weight", "v.patch_embd.weight.1") if "patch" in ours else _QKV
        if set(found) != set(order):
            raise ModelLoadError(model, f"a {KIND} projector without all of {', '.join(order)}")
        pieces = [found[p] for p in order]
        try:  # frames stacked on a new kernel axis; q, k, v rows one after another
            state[ours] = torch.stack(pieces, dim=2) if "patch" in ours else torch.cat(pieces)
        except RuntimeError as exc:
            raise ModelLoadError(
                model, f"a {KIND} projector's {ours} does not fit: {exc}"
            ) from None
    return state
