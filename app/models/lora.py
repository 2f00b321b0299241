"""LoRA adapters beside a model's own weights, never merged into them.

A PEFT adapter adds `scale * B (A x)` to a projection's output, with A (r, in) and
B (out, r) of a small rank r. Our layers fuse q|k|v and gate|up into one projection each,
so an adapter is kept the same way: per layer and fused projection one A, the parts' A
stacked (their ranks summed), and each part's B (its scale folded in), which expands its
share of the shrunk rows into its own columns. Base weights stay as loaded (quantized or
prepacked), and a step of rows of different adapters runs the base projection once for
all rows, then per adapter in the step its rows' shrink (x A^T) and expansions (. B^T),
added to those rows only (S-LoRA's and Punica's grouping, in plain torch ops, over runs
of rows).
"""

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from app.models.dense_mlp import DenseMLP

# PEFT's module name -> (our fused projection, its part)
PROJECTIONS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
KEY = re.compile(r"base_model\.model\.(model\.layers\.(\d+)\.\w+\.(\w+))\.lora_([AB])\.weight")
# PEFT options that change what an adapter computes, and that these layers do not do
REFUSED = ("use_dora", "modules_to_save", "fan_in_fan_out", "alora_invocation_tokens",
           "arrow_config", "use_bdlora", "layer_replication", "megatron_config")  # fmt: skip
_uids = itertools.count(1)
# A^T (in, r_sum), then per part (first output column, its rows of A, (B * scale)^T)
FusedLora = tuple[torch.Tensor, tuple[tuple[int, int, int, torch.Tensor], ...]]


class LoraError(ValueError):
    """An adapter that cannot be read, or does not fit this model."""


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int  # the largest of its modules'
    # per layer: fused projection -> (A^T (in, r_sum), its parts' expansions), laid out as
    # the step's matmuls read them
    layers: tuple[dict[str, "FusedLora"], ...]
    # one per load: KV computed with it is keyed by it (a reload may change the weights)
    uid: int = field(default_factory=lambda: next(_uids))

    @cached_property
    def signature(self) -> tuple:
        """What must be the same for adapters to stack (app.models.lora_batch): each
        projection's shapes (rank, parts' columns and widths). Stacked so, a row's sums
        run over exactly the terms, in the order, its adapter alone sums them: the same
        bits either way."""
        return tuple(
            tuple(
                (p, a.shape, tuple((c, r0, r1, b.shape[1]) for c, r0, r1, b in parts))
                for p, (a, parts) in sorted(layer.items())
            )
            for layer in self.layers
        )

    @property
    def nbytes(self) -> int:
        fused = [f for layer in self.layers for f in layer.values()]
        return sum(a.nbytes + sum(p[3].nbytes for p in parts) for a, parts in fused)


def load_adapter(
    name: str, path: str | Path, model: nn.Module, dtype: torch.dtype, device: torch.device
) -> LoraAdapter:
    """A PEFT LoRA directory (adapter_config.json, adapter_model.safetensors) or a
    llama.cpp LoRA GGUF file, as an adapter of `model` (a DecoderForCausalLM) computing
    in `dtype` on `device`."""
    source = Path(path)
    if source.is_file() and source.suffix == ".gguf":
        from app.models.lora_gguf import read_gguf_lora

        try:
            config, tensors = read_gguf_lora(source, model)
        except ValueError as exc:
            raise LoraError(str(exc)) from exc
    else:
        config, tensors = _read_peft(source)
    return _adapter(name, config, tensors, model, dtype, device)


def _read_peft(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config = _read_config(directory)
    weights_file = directory / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoraError(f"{directory} has no adapter_model.safetensors")
    try:
        return config, load_file(str(weights_file))
    except Exception as exc:  # safetensors' own errors name no common base class
        raise LoraError(f"{weights_file}: {exc}") from exc


def _adapter(
    name: str,
    config: dict,
    tensors: dict[str, torch.Tensor],
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
) -> LoraAdapter:
    """An adapter from PEFT's config and tensors (its key names)."""
    modules: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, str], str] = {}  # PEFT's module names, as its patterns match them
    for key, tensor in tensors.items():
        match = KEY.fullmatch(key)
        if match is None or match.group(3) not in PROJECTIONS:
            raise LoraError(f"adapter tensor {key!r}: only LoRA on {', '.join(PROJECTIONS)}")
        if not torch.isfinite(tensor).all():
            raise LoraError(f"adapter tensor {key!r} holds inf or NaN")
        at = (int(match.group(2)), match.group(3))
        modules.setdefault(at, {})[match.group(4)] = tensor
        names[at] = match.group(1)
    if not modules:
        raise LoraError(f"adapter {name!r} holds no LoRA weights")
    if model.tp.enabled:
        raise LoraError("LoRA adapters do not run with tensor parallelism")
    layers = model.model.layers
    if (last := max(index for index, _ in modules)) >= len(layers):
        raise LoraError(f"layer {last}: the model has {len(layers)} layers")
    fused: list[dict[str, FusedLora]] = [{} for _ in layers]
    for index, layer in enumerate(layers):
        for proj in ("qkv", "o", "gate_up", "down"):
            found = {
                (names[at], part): modules[at]
                for module, (p, part) in PROJECTIONS.items()
                if p == proj and (at := (index, module)) in modules
            }
            if not found:
                continue
            try:
                ab = _fuse(config, found, _parts(layer, proj, index))
            except LoraError:
                raise
            except (re.error, TypeError, AttributeError, ValueError, ZeroDivisionError) as exc:
                raise LoraError(f"layer {index}: {type(exc).__name__}: {exc}") from exc
            a, parts = ab
            fused[index][proj] = (
                a.T.to(device, dtype).contiguous(),
                tuple((c, r0, r1, b.T.to(device, dtype).contiguous()) for c, r0, r1, b in parts),
            )
    rank = max(ab["A"].shape[0] for ab in modules.values())  # each has its A (_fuse)
    return LoraAdapter(name, rank, tuple(fused))


def _read_config(directory: Path) -> dict:
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"{directory}: no readable adapter_config.json ({exc})") from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{directory}: not a LoRA adapter")
    refused = [key for key in REFUSED if config.get(key)]
    if config.get("bias", "none") != "none":
        refused.append("bias")
    if refused:
        raise LoraError(f"{directory}: not supported: {', '.join(refused)}")
    return config


def _scale(config: dict, module: str, rank: int) -> float:
    """PEFT's scale of a module (`module` its name as PEFT's patterns match it, e.g.
    model.layers.0.self_attn.q_proj)."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{pattern})", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _fuse(
    config: dict,
    found: dict[tuple[str, int], dict[str, torch.Tensor]],
    sizes: tuple[int, list[int]],
) -> tuple[torch.Tensor, list[tuple[int, int, int, torch.Tensor]]]:
    """One fused projection's A, its parts' A stacked, and each part's scaled B with the
    columns of the output and the rows of A it belongs to: (column, r0, r1, B)."""
    in_size, out_sizes = sizes
    a_rows, parts = [], []
    rank = 0
    for (name, part), ab in sorted(found.items(), key=lambda kv: kv[0][1]):
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] == 0:
            raise LoraError(f"{name}: lora_A and lora_B, two matrices each")
        r = a.shape[0]
        if a.shape[1] != in_size or tuple(b.shape) != (out_sizes[part], r):
            raise LoraError(
                f"{name}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit this model's "
                f"{in_size} -> {out_sizes[part]} projection"
            )
        a_rows.append(a.float())
        column = sum(out_sizes[:part])
        parts.append((column, rank, rank + r, b.float() * _scale(config, name, r)))
        rank += r
    return torch.cat(a_rows), parts


def _parts(layer: nn.Module, proj: str, index: int) -> tuple[int, list[int]]:
    """(in features, out features of each part) of a layer's fused projection."""
    attn = layer.self_attn
    hidden = layer.input_layernorm.weight.shape[0]
    if proj == "qkv":
        return hidden, [attn.q_size, attn.kv_size, attn.kv_size]
    if proj == "o":
        return attn.q_size, [hidden]
    if not isinstance(layer.mlp, DenseMLP):
        raise LoraError(f"layer {index}'s MLP is a mixture of experts: no LoRA there")
    inter = layer.mlp.intermediate_size
    return (hidden, [inter, inter]) if proj == "gate_up" else (inter, [hidden])
