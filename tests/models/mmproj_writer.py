"""A tiny Gemma 3, Idefics3 (SmolVLM) or Qwen2.5-VL checkpoint's image encoder as llama.cpp's
projector file (mmproj), as its converter writes one (`convert_hf_to_gguf.py --mmproj`,
checked byte for byte against its output for these checkpoints): `clip.*` metadata,
`v.*`/`mm.*` names, Gemma 3's projector norm stored as 1 + w and its input projection in
float16 (the converter forces it) unless `exact`. Tests only: what the loader undoes."""

import json
from pathlib import Path

import gguf
import numpy as np

_NAMES = {
    "embeddings.patch_embedding": "v.patch_embd",
    "embeddings.position_embedding": "v.position_embd",
    "post_layernorm": "v.post_ln",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "layer_norm1": "ln1",
    "layer_norm2": "ln2",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}


def write_gemma3_mmproj(checkpoint: Path, path: Path, exact: bool = False) -> Path:
    return write_mmproj(checkpoint, path, exact)


def write_mmproj(checkpoint: Path, path: Path, exact: bool = False) -> Path:
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    if config["model_type"] == "qwen2_5_vl":
        return write_qwen_mmproj(checkpoint, config, path)
    vision = config["vision_config"]
    kind = "gemma3" if config["model_type"] == "gemma3" else "idefics3"
    w = _clip_writer(
        path,
        config["text_config"]["hidden_size"],
        vision["image_size"],
        vision["patch_size"],
        vision["hidden_size"],
        vision["intermediate_size"],
        vision["num_hidden_layers"],
        vision["num_attention_heads"],
        ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
    )
    w.add_string("clip.projector_type", kind)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", vision.get("layer_norm_eps", 1e-6))
    if kind == "idefics3":
        w.add_uint32("clip.vision.projector.scale_factor", config.get("scale_factor", 2))
    w.add_bool("clip.use_gelu", True)
    if kind == "idefics3":
        pre = json.loads((checkpoint / "processor_config.json").read_text())["image_processor"]
        w.add_uint32("clip.vision.preproc_image_size", pre["size"]["longest_edge"])
    else:
        side = vision["image_size"] // vision["patch_size"]
        scale = side // int(config["mm_tokens_per_image"] ** 0.5)
        if scale != 4:
            w.add_uint32("clip.vision.projector.scale_factor", scale)
    for name, tensor in load_file(str(checkpoint / "model.safetensors")).items():
        array = tensor.float().numpy()
        name = name.removeprefix("model.")
        if name == "connector.modality_projection.proj.weight":
            w.add_tensor("mm.model.fc.weight", array)
            continue
        if name.startswith("multi_modal_projector."):
            if name.endswith("soft_emb_norm.weight"):
                w.add_tensor("mm.soft_emb_norm.weight", array + 1.0)
            else:
                w.add_tensor(
                    "mm.input_projection.weight", array if exact else array.astype(np.float16)
                )
            continue
        if not name.startswith(("vision_tower.", "vision_model.")):
            continue
        rest = name.removeprefix("vision_tower.").removeprefix("vision_model.")
        if rest.startswith("head."):
            continue  # SigLIP's pooling head: unused by Gemma 3, skipped by the converter
        base, _, kind = rest.rpartition(".")
        if base.startswith("encoder.layers."):
            layer, _, part = base.removeprefix("encoder.layers.").partition(".")
            w.add_tensor(f"v.blk.{layer}.{_NAMES[part]}.{kind}", array)
        else:
            w.add_tensor(f"{_NAMES[base]}.{kind}", array)
    return _written(w, path)


_QWEN_PARTS = {
    "attn.proj": "attn_out",
    "norm1": "ln1",
    "norm2": "ln2",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_qwen_mmproj(checkpoint: Path, config: dict, path: Path) -> Path:
    """Qwen2.5-VL's (`qwen2.5vl_merger`): the Conv3d split into one kernel per frame,
    qkv split into q, k, v; the window size and merge are not written (llama.cpp fixes
    them: 112 pixels, 2 x 2)."""
    from safetensors.torch import load_file

    vision = config["vision_config"]
    pre = json.loads((checkpoint / "preprocessor_config.json").read_text())
    full = vision["fullatt_block_indexes"]
    w = _clip_writer(
        path,
        vision["out_hidden_size"],
        vision.get("image_size", 560),
        vision["patch_size"],
        vision["hidden_size"],
        vision["intermediate_size"],
        vision["depth"],
        vision["num_heads"],
        (pre["image_mean"], pre["image_std"]),
    )
    w.add_string("clip.projector_type", "qwen2.5vl_merger")
    w.add_bool("clip.use_silu", True)
    w.add_uint32("clip.vision.n_wa_pattern", full[0] + 1)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", config.get("rms_norm_eps", 1e-6))
    for name, tensor in load_file(str(checkpoint / "model.safetensors")).items():
        array = tensor.float().numpy()
        name = name.removeprefix("model.")
        if not name.startswith("visual."):
            continue
        base, _, kind = name.removeprefix("visual.").rpartition(".")
        if base == "patch_embed.proj":
            w.add_tensor("v.patch_embd.weight", array[:, :, 0])
            w.add_tensor("v.patch_embd.weight.1", array[:, :, 1])
        elif base == "merger.ln_q":
            w.add_tensor(f"v.post_ln.{kind}", array)
        elif base.startswith("merger.mlp."):
            w.add_tensor(f"mm.{base.removeprefix('merger.mlp.')}.{kind}", array)
        else:
            layer, _, part = base.removeprefix("blocks.").partition(".")
            if part == "attn.qkv":
                for letter, rows in zip("qkv", np.split(array, 3), strict=True):
                    w.add_tensor(f"v.blk.{layer}.attn_{letter}.{kind}", rows)
            else:
                w.add_tensor(f"v.blk.{layer}.{_QWEN_PARTS[part]}.{kind}", array)
    return _written(w, path)


def _clip_writer(path: Path, projection: int, *sizes: int | tuple) -> gguf.GGUFWriter:
    """A projector file's writer with the keys every type has, in the converter's order:
    projection width, image size, patch, width, MLP width, layers, heads, (mean, std)."""
    image, patch, width, inner, layers, heads, (mean, std) = sizes
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", projection)
    w.add_uint32("clip.vision.image_size", image)
    w.add_uint32("clip.vision.patch_size", patch)
    w.add_uint32("clip.vision.embedding_length", width)
    w.add_uint32("clip.vision.feed_forward_length", inner)
    w.add_uint32("clip.vision.block_count", layers)
    w.add_uint32("clip.vision.attention.head_count", heads)
    w.add_array("clip.vision.image_mean", mean)
    w.add_array("clip.vision.image_std", std)
    return w


def _written(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
