"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Tokens of all sequences in a step are flattened into one (T, hidden) batch; attention
is the only place that knows where one sequence ends and the next begins, through the
backend metadata passed into `forward`.
"""

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from app.models.arch import ArchConfig
from app.models.attention import AttentionBackend
from app.models.cpu_linear import PackedLinear, linear_add
from app.models.fused_ops import RopeTables, rms_norm, rotate_heads_
from app.models.parallel import TPGroup, kv_head_range, shard_arch, slice_rows, vocab_range
from app.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def linear_add_reduce(
    layer: nn.Module, x: torch.Tensor, residual: torch.Tensor, tp: TPGroup
) -> torch.Tensor:
    """residual + layer(x) for a row-parallel layer: each shard's partial product is
    summed over the shards, and the residual is added once (by rank 0)."""
    if not tp.enabled:
        return linear_add(layer, x, residual)
    out = linear_add(layer, x, residual) if tp.rank == 0 else layer(x)
    return tp.all_reduce_(out)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, backend: AttentionBackend, tp: TPGroup):
        """`arch` holds this shard's head counts (see parallel.shard_arch)."""
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
        )
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.scale = arch.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=arch.qkv_bias
        )
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=False)
        self.backend = backend
        # Bound by the model runner once the cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, rope: RopeTables, x: torch.Tensor, attn_metadata: Any, residual: torch.Tensor
    ) -> torch.Tensor:
        """Returns residual + attention(x)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, (nh + 2 nkv) hd)
        # q and k are adjacent: rotate both in place in one call.
        rotate_heads_(qkv, rope, self.num_heads + self.num_kv_heads, self.head_dim)
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)  # (T, nh, hd)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            t, self.num_kv_heads, self.head_dim
        )
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, attn_metadata, self.scale)
        return linear_add_reduce(self.o_proj, out.reshape(t, self.q_size), residual, self.tp)


class LlamaMLP(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.fused: tuple[PackedLinear, PackedLinear] | None = None  # (gate, up), see fuse_for_cpu

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Returns residual + mlp(x)."""
        if self.fused is not None:
            gate, up = self.fused
            h = up.mul(x, gate.swish(x))  # silu(gate(x)) * up(x), in the GEMM epilogues
        else:
            g, u = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
            h = F.silu(g) * u
        return linear_add_reduce(self.down_proj, h, residual, self.tp)

    def fuse_for_cpu(self) -> None:
        """Split gate/up into two prepacked layers whose epilogues apply silu and the
        product, and prepack the down projection (bf16 on CPU only)."""
        gate_w, up_w = self.gate_up_proj.weight.detach().split(self.intermediate_size, dim=0)
        self.fused = (PackedLinear.from_weight(gate_w), PackedLinear.from_weight(up_w))
        del self.gate_up_proj
        self.down_proj = PackedLinear(self.down_proj)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, backend: AttentionBackend, tp: TPGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, backend, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch, tp)

    def forward(self, rope: RopeTables, h: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        h = self.self_attn(rope, self.input_layernorm(h), attn_metadata, residual=h)
        return self.mlp(self.post_attention_layernorm(h), residual=h)


class LlamaModel(nn.Module):
    def __init__(
        self, arch: ArchConfig, backend: AttentionBackend, max_positions: int, tp: TPGroup
    ):
        super().__init__()
        self.tp = tp
        self.rotary = RotaryEmbedding(
            arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling
        )
        self.vocab_start, vocab_local = vocab_range(arch.vocab_size, tp)
        self.embed_tokens = nn.Embedding(vocab_local, arch.hidden_size)
        local = shard_arch(arch, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(local, backend, tp) for _ in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return self.embed_tokens(input_ids)
        # Vocab-parallel: each shard embeds the ids in its slice, zeros elsewhere, and
        # the sum over shards is the full embedding.
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed_tokens.num_embeddings)
        h = self.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce_(h.masked_fill_(outside.unsqueeze(-1), 0))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        h = self.embed(input_ids)  # (T, hidden)
        rope = self.rotary.tables(positions)
        for layer in self.layers:
            h = layer(rope, h, attn_metadata)
        return self.norm(h)


# HF checkpoint name -> (our fused parameter, which part of it)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        backend: AttentionBackend,
        max_positions: int,
        tp: TPGroup = TPGroup(),  # noqa: B008 (frozen)
    ):
        super().__init__()
        self.arch = arch  # the whole model's sizes
        self.local = shard_arch(arch, tp)  # the sizes this shard computes with
        self.tp = tp
        self.model = LlamaModel(arch, backend, max_positions, tp)
        self.lm_head = nn.Linear(
            arch.hidden_size, self.model.embed_tokens.num_embeddings, bias=False
        )
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        attn_metadata: Any,
        logits_indices: torch.Tensor,  # (S,) rows of the batch whose next token is sampled
    ) -> torch.Tensor:
        h = self.model(input_ids, positions, attn_metadata)
        logits = self.tp.gather_last_dim(self.lm_head(h[logits_indices]))
        if logits is None:  # not rank 0: sampling happens there
            return torch.empty(0)
        return logits[:, : self.arch.vocab_size]  # (S, vocab), model dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (fused) parameters; returns the names filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            target, shard = self._target(name)
            if target not in params:
                raise KeyError(f"unexpected tensor {name!r}")
            param = params[target]
            tensor = self._tp_slice(name, tensor)
            dest = param.data if shard is None else self._shard_view(param.data, target, shard)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(target if shard is None else f"{target}#{shard}")
        return loaded

    def expected_weights(self) -> set[str]:
        names = set()
        for name, _ in self.named_parameters():
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                names.update(f"{name}#{i}" for i in range(3))
            elif name.endswith("gate_up_proj.weight"):
                names.update(f"{name}#{i}" for i in range(2))
            else:
                names.add(name)
        return names

    @staticmethod
    def _target(name: str) -> tuple[str, int | None]:
        for hf_part, (ours, shard) in _STACKED.items():
            if f".{hf_part}." in name:
                return name.replace(hf_part, ours), shard
        return name, None

    def _tp_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This shard's part of a whole checkpoint tensor (the tensor itself at TP=1)."""
        tp, local = self.tp, self.local
        if not tp.enabled:
            return tensor
        if "embed_tokens" in name or name.startswith("lm_head"):
            return slice_rows(tensor, *vocab_range(self.arch.vocab_size, tp))
        if ".q_proj." in name:
            return tensor.narrow(0, tp.rank * local.q_size, local.q_size)
        if ".k_proj." in name or ".v_proj." in name:
            first, count = kv_head_range(self.arch, tp)
            return tensor.narrow(0, first * local.head_dim, count * local.head_dim)
        if ".o_proj." in name:
            return tensor.narrow(1, tp.rank * local.q_size, local.q_size)
        if ".gate_proj." in name or ".up_proj." in name:
            return tensor.narrow(0, tp.rank * local.intermediate_size, local.intermediate_size)
        if ".down_proj." in name:
            return tensor.narrow(1, tp.rank * local.intermediate_size, local.intermediate_size)
        return tensor  # norms: replicated

    def _shard_view(self, data: torch.Tensor, target: str, shard: int) -> torch.Tensor:
        arch = self.local
        if "qkv_proj" in target:
            sizes = [arch.q_size, arch.kv_size, arch.kv_size]
        else:
            sizes = [arch.intermediate_size, arch.intermediate_size]
        offset = sum(sizes[:shard])
        return data.narrow(0, offset, sizes[shard])
