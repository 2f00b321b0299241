"""llama.cpp's LoRA GGUF files (convert_lora_to_gguf.py's output), read as PEFT's
config and tensors, so that one path (app/models/lora.py) builds every adapter.

The file names its base's architecture and llama.cpp's tensors (`blk.N.attn_q.weight`
with `.lora_a` (r, in) and `.lora_b` (out, r)), and one `adapter.lora.alpha`: llama.cpp
scales each tensor pair by alpha over its own rank, or by 1 when alpha is 0. Its
converter put a Llama's q and k rows in llama.cpp's rotary order, as it does the base
weights: B's rows are put back, as the base loader puts back the base's.
"""

import re
from pathlib import Path

import numpy as np
import torch
from torch import nn

from app.models.gguf_names import hf_name
from app.models.weights import unpermute


def read_gguf_lora(path: Path, model: nn.Module) -> tuple[dict, dict[str, torch.Tensor]]:
    """(PEFT adapter config, tensors by PEFT's key names) of the LoRA GGUF at `path`,
    for `model` (its head counts, for a Llama's q and k); ValueError saying what is
    wrong with the file."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError, OSError, struct and numpy errors
        raise ValueError(f"{path}: not a GGUF file ({exc})") from exc

    def field(key: str, default: object = None) -> object:
        found = reader.fields.get(key)
        return default if found is None else found.contents()

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise ValueError(f"{path}: not a LoRA adapter GGUF")
    if field("adapter.alora_invocation_tokens") is not None:
        raise ValueError(f"{path}: not supported: alora_invocation_tokens")
    arch, alpha = str(field("general.architecture", "")), float(field("adapter.lora.alpha", 0))
    attn = model.model.layers[0].self_attn
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        base, _, half = tensor.name.rpartition(".")
        try:
            name = hf_name(base, arch) if half in ("lora_a", "lora_b") else None
        except KeyError:
            name = None
        if name is None or not name.endswith(".weight"):
            raise ValueError(f"{path}: tensor {tensor.name!r} is no LoRA of a known weight")
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ValueError(f"{path}: cannot decode tensor {tensor.name}: {exc}") from exc
        data = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
        if half == "lora_b" and arch == "llama" and ".q_proj." in name:
            data = unpermute(data, attn.num_heads)
        elif half == "lora_b" and arch == "llama" and ".k_proj." in name:
            data = unpermute(data, attn.num_kv_heads)
        tensors[f"base_model.model.{name[: -len('.weight')]}.lora_{half[-1].upper()}.weight"] = data
    config: dict = {"peft_type": "LORA", "lora_alpha": alpha}
    if alpha == 0:  # llama.cpp's scale 1: each module's alpha its own rank
        config["alpha_pattern"] = {
            re.escape(
                key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            ): a.shape[0]
            for key, a in tensors.items()
            if key.endswith(".lora_A.weight")
        }
    return config, tensors
