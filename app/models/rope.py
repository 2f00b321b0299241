"""Rotary position embeddings (HF's rotate-half layout), with linear, llama3, YaRN and
LongRoPE scaling."""

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, scaling)
    if rope_type == "divisors":  # llama.cpp's rope_freqs: explicit per-frequency divisors
        return inv_freq / torch.tensor(scaling["divisors"], dtype=torch.float32)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between smoothed.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5/3 long context, DeepSeek): interpolate the low frequencies by
    `factor`, keep the high ones, ramp between; cos/sin scaled by an attention factor.
    (inverse frequencies, attention factor), as transformers computes them."""
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings") or scaling["max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(
                factor, scaling["mscale_all_dim"]
            )
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp  # share of the unscaled frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3's LongRoPE: per-frequency divisors, and cos/sin scaled by an attention factor.

    One set of divisors serves every position, chosen by the context served, as
    llama.cpp does: `long_factor` when it exceeds the pretraining length, else
    `short_factor`. (transformers switches a whole sequence to the long factors once it
    outgrows that length, which a KV cache cannot follow: keys already cached keep the
    short rotation. Below the pretraining length both agree.)"""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling.get("max_position_embeddings", original) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    key = "long_factor" if max_positions > original else "short_factor"
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * theta**shape)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]):
        super().__init__()
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type == "longrope":
            cos, sin = _longrope(head_dim, max_positions, theta, scaling)
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn(head_dim, theta, scaling)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
        else:
            inv_freq = inverse_frequencies(head_dim, theta, scaling)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)  # (P, hd)
            cos, sin = emb.cos(), emb.sin()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # M-RoPE (Qwen2.5-VL): which of the three positions each column's band takes.
        bands = [i for i, n in enumerate(scaling.get("mrope_section") or ()) for _ in range(n)]
        self.bands = torch.tensor(bands * 2, dtype=torch.long) if bands else None

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin for these positions, (T, hd); once per forward pass.
        `positions` (3, T): M-RoPE's temporal, row and column positions."""
        if positions.dim() == 1:
            return self.cos[positions], self.sin[positions]
        bands = self.bands.to(positions.device)
        rows = positions[bands].T  # (T, hd): each column's position
        columns = torch.arange(len(bands), device=positions.device)
        return self.cos[rows, columns], self.sin[rows, columns]
