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
