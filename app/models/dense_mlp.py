"""The gated MLP every family shares: down(act(gate(x)) * up(x)), gate and up fused."""

import torch
import torch.nn.functional as F
from torch import nn

from app.models.cpu_linear import PackedLinear
from app.models.fused_ops import silu_mul


def activate(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh")  # gelu_tanh (Gemma)


class DenseMLP(nn.Module):
    """Returns this shard's partial sum of the MLP (the caller all-reduces and adds the
    residual; with no tensor parallelism `forward_add` fuses the add into down_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__()
        self.intermediate_size, self.act = intermediate_size, act
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.fused: tuple[PackedLinear, PackedLinear] | None = None  # (gate, up), see fuse_for_cpu
        # False for quantized models (allow_inexact_float32): silu * up in the C++ kernel the
        # fused decoder layers call too, where a token must come out the same either way.
        self.exact = True

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """gate(x) | up(x), before the activation."""
        if self.fused is not None:
            return torch.cat([self.fused[0](x), self.fused[1](x)], dim=-1)
        return self.gate_up_proj(x)

    def hidden(self, x: torch.Tensor, gate_up: torch.Tensor | None = None) -> torch.Tensor:
        """act(gate(x)) * up(x); from `gate_up` when given (gate_up(x) and more: LoRA)."""
        if gate_up is None and self.fused is not None:
            gate, up = self.fused
            if self.act == "silu":
                return up.mul(x, gate.swish(x))  # in the GEMM epilogues
            return up.mul(x, activate(gate(x), self.act))
        if gate_up is None:
            gate_up = self.gate_up_proj(x)
        if self.act == "silu":
            return silu_mul(gate_up, self.intermediate_size, self.exact)
        g, u = gate_up.split(self.intermediate_size, dim=-1)
        return activate(g, self.act) * u

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))

    def fuse_for_cpu(self) -> None:
        """Split gate/up into two prepacked layers whose epilogues apply silu and the
        product, and prepack the down projection (bf16 on CPU only). Quantized layers
        keep their own kernels."""
        if not isinstance(self.gate_up_proj, nn.Linear):
            if isinstance(self.down_proj, nn.Linear):
                self.down_proj = PackedLinear(self.down_proj)
            return
        gate_w, up_w = self.gate_up_proj.weight.detach().split(self.intermediate_size, dim=0)
        self.fused = (PackedLinear.from_weight(gate_w), PackedLinear.from_weight(up_w))
        del self.gate_up_proj
        self.down_proj = PackedLinear(self.down_proj)
