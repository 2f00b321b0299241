"""Which of a model's layers keep their weights quantized, and putting quantized layers
in their place.

GGUF (`quantization` auto or gguf): every linear layer and the token embedding whose
checkpoint tensors arrive quantized in a type our kernels run (QuantizedTensor) becomes
a QuantLinear / QuantEmbedding before the weights are loaded, and a MoE layer whose
experts do keeps them quantized (SparseMoE.keep_quantized); an LM head tied to a
quantized embedding reads its rows. int8: after a float load, every linear layer's
weight is quantized to Q8_0 (blocks of 32 with their own scale: finer than one scale
per output channel, at 8.5 bits a weight).
"""

from collections.abc import Iterable

import torch
from torch import nn

from app.models.moe import SparseMoE
from app.models.quant.linear_module import QuantEmbedding, QuantLinear
from app.models.quantized_tensor import QuantizedTensor
from app.models.weight_loading import piece_rows, target_module

Q8_0 = 8  # GGML type id


def quantized_targets(
    weights: Iterable[tuple[str, object]], model: nn.Module, tied: bool
) -> set[str]:
    """Names of the modules whose weight arrives (wholly or in part) quantized."""
    return {
        target_module(name, model)
        for name, tensor in weights
        if isinstance(tensor, QuantizedTensor) and not (tied and name == "lm_head.weight")
    }


def install(model: nn.Module, targets: set[str], tied: bool) -> None:
    """Replace the (meta) layers named in `targets` by quantized ones of the same shape."""
    for name in sorted(targets):
        parent, _, attr = name.rpartition(".")
        old = model.get_submodule(name)
        if isinstance(old, SparseMoE):  # its routed experts (app/models/quant/experts.py)
            old.keep_quantized()
            continue
        if isinstance(old, nn.Embedding):
            new: nn.Module = QuantEmbedding(old.num_embeddings, old.embedding_dim)
        elif isinstance(old, nn.Linear):
            rows = piece_rows(name, old, model.local)
            new = QuantLinear(old.in_features, rows, old.bias is not None)
        else:
            raise TypeError(f"{name} ({type(old).__name__}) cannot hold a quantized weight")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    embed = model.model.embed_tokens
    if tied and isinstance(embed, QuantEmbedding):
        model.lm_head = QuantLinear.tied(embed)


def quantize_linears(module: nn.Module) -> int:
    """int8 weight-only: every nn.Linear under `module` (fused or not) as Q8_0 blocks."""
    import gguf
    import numpy as np

    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.in_features % 32 == 0:
            weight = child.weight.detach().float().numpy()
            raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
            layer = QuantLinear(child.in_features, [child.out_features], child.bias is not None)
            layer.set_segment(
                0,
                QuantizedTensor(
                    torch.from_numpy(np.ascontiguousarray(raw)), Q8_0, child.in_features
                ),
            )
            if child.bias is not None:
                layer.bias = nn.Parameter(child.bias.detach().clone(), requires_grad=False)
            setattr(module, name, layer)
            count += 1
        else:
            count += quantize_linears(child)
    return count


def set_output_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    for module in model.modules():
        if isinstance(module, QuantEmbedding):
            module.out_dtype = dtype


def allow_inexact_float32(model: nn.Module) -> None:
    """Norms, RoPE and the MLP's silu * up through the C++ kernels in float32 too: a
    quantized model differs from transformers' anyway, and those kernels replace ~20 small
    torch ops per layer."""
    for module in model.modules():
        if hasattr(module, "exact"):
            module.exact = False


def quantized_bytes(model: nn.Module) -> int:
    layers = sum(m.nbytes() for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding))
    experts = sum(
        m.quantized.nbytes()
        for m in model.modules()
        if isinstance(m, SparseMoE) and m.quantized is not None
    )
    return layers + experts
