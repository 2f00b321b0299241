"""Random PEFT LoRA adapters made by peft itself, for the LoRA tests."""

from pathlib import Path
from typing import Any

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapter(hf_model: Any, directory: Path, seed: int, settings: dict) -> Path:
    """A LoRA adapter of `hf_model` with random weights (peft starts B at zero, which
    would test nothing), saved to `directory`; the model is left as it was."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **settings)
    wrapped = peft.get_peft_model(hf_model, config)
    with torch.no_grad():  # big enough to change greedy picks, not to drown the model
        for name, param in wrapped.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                param.normal_(0, 0.05)
    wrapped.save_pretrained(directory)
    wrapped.unload()
    return directory


# PEFT's module -> llama.cpp's tensor (convert_hf_to_gguf's names for a Llama)
GGUF_PARTS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
              "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
              "down_proj": "ffn_down"}  # fmt: skip


def write_lora_gguf(peft_dir: Path, path: Path, n_head: int, n_kv_head: int) -> Path:
    """`peft_dir`'s adapter as llama.cpp's convert_lora_to_gguf.py writes it for a Llama
    base (float32): the same metadata, tensor names and values, in the same order (checked
    against the converter of llama.cpp as vendored in llama-cpp-python 0.3.36)."""
    import json
    import re

    import gguf
    from safetensors.torch import load_file

    config = json.loads((peft_dir / "adapter_config.json").read_text())
    tensors = load_file(str(peft_dir / "adapter_model.safetensors"))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    key = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight")
    for name in sorted(tensors):  # as safetensors keeps them, and the converter reads
        layer, module, half = key.fullmatch(name).groups()
        data = tensors[name].float()
        if half == "B" and module in ("q_proj", "k_proj"):
            heads = n_head if module == "q_proj" else n_kv_head
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, -1).swapaxes(1, 2)
            data = data.reshape(tensors[name].shape)
        gguf_name = f"blk.{layer}.{GGUF_PARTS[module]}.weight.lora_{half.lower()}"
        writer.add_tensor(gguf_name, data.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
