"""RMSNorm, RoPE and silu(gate) * up with C++ fast paths (app/models/cpu_kernels) for
reduced precision on CPU, where torch spends more time converting dtypes than computing.

float32 takes transformers' exact op sequence unless the caller passes exact=False: the
token-identical tests against transformers run in float32 and rely on it. A model that
cannot match transformers bit for bit anyway (quantized weights) passes False, and its
float32 decode step then makes two kernel calls per layer where torch made ~20 ops.
"""

import torch
import torch.nn.functional as F

from app.models import cpu_kernels

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin: (T, hd) float32


def _kernels_for(x: torch.Tensor, exact: bool):  # noqa: ANN202 (an extension module or None)
    if (exact and x.dtype == torch.float32) or x.device.type != "cpu":
        return None
    return cpu_kernels.load()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, exact: bool = True) -> torch.Tensor:
    kernels = _kernels_for(x, exact)
    if kernels is not None and x.dim() == 2 and x.is_contiguous():
        return kernels.rms_norm(x, weight, eps)
    if x.dtype != torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_heads_(
    x: torch.Tensor,
    rope: RopeTables,
    heads: int,
    head_dim: int,
    rotary_dim: int | None = None,
    exact: bool = True,
) -> None:
    """Apply RoPE in place to the first `heads` heads of each row of x: (T, width); with
    `rotary_dim`, to the first rotary_dim channels of each head only (partial RoPE)."""
    cos, sin = rope
    rotary_dim = rotary_dim or head_dim
    kernels = _kernels_for(x, exact)
    if kernels is not None and rotary_dim == head_dim:
        kernels.rotary_inplace(x, cos, sin, heads)
        return
    t, half = x.shape[0], rotary_dim // 2
    part = x[:, : heads * head_dim].view(t, heads, head_dim)[..., :rotary_dim]
    c, s = cos.to(x.dtype).unsqueeze(1), sin.to(x.dtype).unsqueeze(1)  # (T, 1, hd)
    rotated = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
    part.copy_(part * c + rotated * s)


def silu_mul(gate_up: torch.Tensor, inter: int, exact: bool = True) -> torch.Tensor:
    """silu(gate) * up of a gate|up product (T, 2 * inter). exact=False (quantized models)
    takes the C++ kernel for float32 rows, the one the fused decoder layers call, so a
    token gets the same bits on either path."""
    kernels = _kernels_for(gate_up, exact)
    if kernels is not None and gate_up.dtype == torch.float32 and gate_up.dim() == 2:
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    return F.silu(gate) * up
