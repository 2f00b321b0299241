"""The pre-norm decoder every supported family is, over a paged KV cache.

Families differ by switches in ArchConfig (see app/models/families): q/k norms, norms
around both sublayers (Gemma), soft-capping, sliding windows, partial RoPE, routed
experts. Tokens of all sequences in a step are flattened into one (T, hidden) batch;
attention is the only place that knows where one sequence ends and the next begins,
through the backend metadata passed into `forward`.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from app.models.arch import ArchConfig
from app.models.attention import AttentionBackend, DecodeInputs
from app.models.cpu_linear import linear_add
from app.models.dense_mlp import DenseMLP
from app.models.fused_ops import RopeTables, rms_norm, rotate_heads_
from app.models.lora_batch import LoraBatch
from app.models.moe import SparseMoE
from app.models.parallel import TPGroup, shard_arch, vocab_range
from app.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.exact = True  # float32 as transformers computes it (fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.exact)


def linear_add_reduce(
    layer: nn.Module, x: torch.Tensor, residual: torch.Tensor, tp: TPGroup
) -> torch.Tensor:
    """residual + layer(x) for a row-parallel layer: each shard's partial product is
    summed over the shards, and the residual is added once (by rank 0)."""
    if not tp.enabled:
        return linear_add(layer, x, residual)
    out = linear_add(layer, x, residual) if tp.rank == 0 else layer(x)
    return tp.all_reduce_(out)


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig, layer: int, backend: AttentionBackend, tp: TPGroup):
        """`arch` holds this shard's head counts (see parallel.shard_arch)."""
        super().__init__()
        self.tp = tp
        self.layer = layer
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.rotary_dim = arch.rotary_dim or arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.scale = arch.scale
        # Only the switches a family uses reach the backend: Llama's call is unchanged.
        self.attn_options: dict[str, Any] = {}
        if arch.window(layer):
            self.attn_options["window"] = arch.window(layer)
        if arch.attn_softcap:
            self.attn_options["softcap"] = arch.attn_softcap
        self.qkv_proj = nn.Linear(
            arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=arch.qkv_bias
        )
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.backend = backend
        self.exact = True  # float32 RoPE as transformers computes it (fused_ops)
        # Bound by the model runner once the cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self,
        rope: RopeTables,
        x: torch.Tensor,
        attn_metadata: Any,
        residual: torch.Tensor | None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """residual + attention(x); without a residual, attention(x) summed over shards."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, (nh + 2 nkv) hd)
        if lora is not None:
            qkv = lora.add_(qkv, x, self.layer, "qkv")
        if self.q_norm is not None:
            self._norm_heads(qkv)
        # q and k are adjacent: rotate both in place in one call.
        heads = self.num_heads + self.num_kv_heads
        rotate_heads_(qkv, rope, heads, self.head_dim, self.rotary_dim, self.exact)
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)  # (T, nh, hd)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            t, self.num_kv_heads, self.head_dim
        )
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(
            q, k, v, self.k_cache, self.v_cache, attn_metadata, self.scale, **self.attn_options
        ).reshape(t, self.q_size)
        if residual is None:
            o = self.o_proj(out)
            return self.tp.all_reduce_(o if lora is None else lora.add_(o, out, self.layer, "o"))
        if lora is not None:
            residual = lora.add_(residual, out, self.layer, "o")
        return linear_add_reduce(self.o_proj, out, residual, self.tp)

    def _norm_heads(self, qkv: torch.Tensor) -> None:
        """RMSNorm over each query and key head, in place (before RoPE, as Qwen3/Gemma 3)."""
        t, hd = qkv.shape[0], self.head_dim
        q = qkv[:, : self.q_size]
        k = qkv[:, self.q_size : self.q_size + self.kv_size]
        q.copy_(self.q_norm(q.reshape(t * self.num_heads, hd)).view(t, self.q_size))
        k.copy_(self.k_norm(k.reshape(t * self.num_kv_heads, hd)).view(t, self.kv_size))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer: int, backend: AttentionBackend, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.index = layer
        self.local_rope = arch.local_rope_theta is not None and arch.window(layer) > 0
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer, backend, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.sandwich = arch.sandwich_norms
        if self.sandwich:  # Gemma: post_attention_layernorm normalises the attention output
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp: nn.Module = (
            SparseMoE(arch)
            if arch.is_sparse(layer)
            else DenseMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act)
        )
        # This layer in one C++ call for a step the decode kernel attends whole
        # (app/models/quant/fused_decode.py).
        self.fused_decode: (
            Callable[[RopeTables, torch.Tensor, DecodeInputs], torch.Tensor] | None
        ) = None

    def forward(
        self, rope: RopeTables, h: torch.Tensor, attn_metadata: Any, lora: LoraBatch | None = None
    ) -> torch.Tensor:
        if self.sandwich:
            a = self.self_attn(rope, self.input_layernorm(h), attn_metadata, None, lora)
            h = h + self.post_attention_layernorm(a)
            m = self.tp.all_reduce_(self._mlp(self.pre_feedforward_layernorm(h), lora))
            return h + self.post_feedforward_layernorm(m)
        h = self.self_attn(rope, self.input_layernorm(h), attn_metadata, h, lora)
        x = self.post_attention_layernorm(h)
        if isinstance(self.mlp, DenseMLP):
            if lora is None:
                return linear_add_reduce(self.mlp.down_proj, self.mlp.hidden(x), h, self.tp)
            y = self._hidden(x, lora)
            return linear_add_reduce(
                self.mlp.down_proj, y, lora.add_(h, y, self.index, "down"), self.tp
            )
        return h + self.tp.all_reduce_(self.mlp(x))

    def _mlp(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        """This shard's MLP output, with the step's adapters where the MLP is dense."""
        if lora is None or not isinstance(self.mlp, DenseMLP):
            return self.mlp(x)
        y = self._hidden(x, lora)
        return lora.add_(self.mlp.down_proj(y), y, self.index, "down")

    def _hidden(self, x: torch.Tensor, lora: LoraBatch) -> torch.Tensor:
        """The dense MLP's act(gate) * up, the adapters added before the activation."""
        return self.mlp.hidden(x, lora.add_(self.mlp.gate_up(x), x, self.index, "gate_up"))


class DecoderModel(nn.Module):
    def __init__(
        self, arch: ArchConfig, backend: AttentionBackend, max_positions: int, tp: TPGroup
    ):
        super().__init__()
        self.tp = tp
        self.rotary, self.rotary_local = rotary_tables(arch, max_positions)
        self.vocab_start, vocab_local = vocab_range(arch.vocab_size, tp)
        self.arch_vocab = arch.vocab_size
        self.embed_tokens = nn.Embedding(vocab_local, arch.hidden_size)
        self.embed_scale = arch.embed_scale
        local = shard_arch(arch, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(local, i, backend, tp) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.backend = backend
        self.fused_decode = False  # every layer has its fused_decode

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            h = self.embed_tokens(input_ids)
        else:
            # Vocab-parallel: each shard embeds the ids in its slice, zeros elsewhere, and
            # the sum over shards is the full embedding.
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.embed_tokens.num_embeddings)
            h = self.embed_tokens(local.masked_fill(outside, 0))
            h = self.tp.all_reduce_(h.masked_fill_(outside.unsqueeze(-1), 0))
        if self.embed_scale != 1.0:  # Gemma: the scale is rounded to the model's dtype first
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return h

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """`images`: rows of the batch that read an image encoder's rows, and those rows;
        their ids are past the vocabulary (app.engine.images). `lora`: the adapters of
        the step's rows (app.models.lora), beside the base weights: the fused decode
        layers have none."""
        if images is None:
            h = self.embed(input_ids)  # (T, hidden)
        else:
            h = self.embed(input_ids.masked_fill(input_ids >= self.arch_vocab, 0))
            h[images[0]] = images[1].to(h.dtype)  # unscaled: Gemma scales only text
        rope = self.rotary.tables(positions)
        local = self.rotary_local.tables(positions) if self.rotary_local is not None else rope
        fused = self.fused_decode and lora is None
        decodes = self.backend.decode_inputs(attn_metadata) if fused else None
        for layer in self.layers:
            tables = local if layer.local_rope else rope
            if decodes is not None:
                h = layer.fused_decode(tables, h, decodes)
            else:
                h = layer(tables, h, attn_metadata, lora)
        return self.norm(h)


def rotary_tables(
    arch: ArchConfig, max_positions: int
) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """The RoPE tables of the global layers and, where a family gives its sliding layers
    another base (Gemma 3), theirs."""
    dim = arch.rotary_dim or arch.head_dim
    rotary = RotaryEmbedding(dim, max_positions, arch.rope_theta, arch.rope_scaling)
    local = None
    if arch.local_rope_theta is not None:
        local = RotaryEmbedding(dim, max_positions, arch.local_rope_theta, {})
    return rotary, local


class DecoderForCausalLM(nn.Module):
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
        self.model = DecoderModel(arch, backend, max_positions, tp)
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
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        h = self.model(input_ids, positions, attn_metadata, images, lora)
        logits = self.tp.gather_last_dim(self.lm_head(h[logits_indices]))
        if logits is None:  # not rank 0: sampling happens there
            return torch.empty(0)
        logits = logits[:, : self.arch.vocab_size]  # (S, vocab), model dtype
        cap = self.arch.final_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
