"""Routed experts (Mixtral, Qwen2/3-MoE): each token's top-k experts by the router's
softmax, and, for Qwen2-MoE, a shared expert scaled by a sigmoid gate.

Experts are stored stacked, (E, 2I, H) for gate|up and (E, H, I) for down, so one step
runs one GEMM pair per expert that received tokens: tokens are grouped by expert, each
group goes through its expert as a batch, and each token's k weighted outputs are summed
(for k = 2 the same float32 sum transformers forms, whatever the order).
Under tensor parallelism every shard holds a slice of every expert's intermediate
dimension, like a dense MLP; the router is replicated.

From a GGUF file on one CPU shard the experts stay quantized (`keep_quantized`,
app/models/quant/experts.py): each projection of every active expert is then one
kernel call over the packed weights.
"""

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from app.models.arch import ArchConfig
from app.models.dense_mlp import DenseMLP, activate
from app.models.quant.experts import QuantizedExperts


class SparseMoE(nn.Module):
    def __init__(self, arch: ArchConfig):
        """`arch` holds this shard's expert sizes (see parallel.shard_arch)."""
        super().__init__()
        moe = arch.moe
        assert moe is not None
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.normalize, self.float32_weights = moe.normalize_top_k, moe.float32_weights
        self.act = arch.hidden_act
        self.inter = moe.intermediate_size
        self.gate = nn.Linear(arch.hidden_size, moe.num_experts, bias=False)  # the router
        self.expert_gate_up = nn.Parameter(
            torch.empty(moe.num_experts, 2 * self.inter, arch.hidden_size)
        )
        self.expert_down = nn.Parameter(torch.empty(moe.num_experts, arch.hidden_size, self.inter))
        self.shared_expert: DenseMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = DenseMLP(
                arch.hidden_size, moe.shared_intermediate_size, arch.hidden_act
            )
            self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False)
        self.quantized: QuantizedExperts | None = None

    def keep_quantized(self) -> None:
        """Experts from quantized checkpoint pieces (QuantizedExperts.set_piece, called by
        the loader), not the float parameters, which go."""
        dtype = self.expert_down.dtype
        del self.expert_gate_up, self.expert_down
        hidden = self.gate.in_features
        self.quantized = QuantizedExperts(self.num_experts, self.inter, hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This shard's partial sum of the experts' outputs (all-reduced by the caller)."""
        logits = self.gate(x)
        out = None
        if self.quantized is not None:  # one C++ call where the weights and x allow
            out = self.quantized.routed(x, logits, self.top_k, self.normalize, self.act)
        if out is None:
            out = self._routed(x, logits)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out += torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out

    def _routed(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        t, k = x.shape[0], self.top_k
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # (T, E)
        weights, chosen = torch.topk(probs, k, dim=-1)  # (T, k)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if not self.float32_weights:
            weights = weights.to(x.dtype)
        # (token, slot) pairs grouped by expert, each group one batch through its expert.
        order = torch.argsort(chosen.flatten(), stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts).tolist()
        xs = x[order // k]  # (T*k, H)
        if self.quantized is not None:
            starts = [0, *itertools.accumulate(counts)]
            ys = self.quantized.forward(xs, starts, self.act)
        else:
            ys = torch.empty_like(xs)
            start = 0
            for expert, n in enumerate(counts):
                if n == 0:
                    continue
                rows = slice(start, start + n)
                g, u = F.linear(xs[rows], self.expert_gate_up[expert]).split(self.inter, dim=-1)
                ys[rows] = F.linear(activate(g, self.act) * u, self.expert_down[expert])
                start += n
        ys = (ys * weights.flatten()[order, None]).to(x.dtype)
        # Back to (token, slot) order by a gather (index_add_ on CPU goes row by row), then
        # the k slots summed.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return ys[inverse].view(t, k, -1).sum(dim=1)
