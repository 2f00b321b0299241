"""Paged attention in plain torch: gathers each sequence's blocks, then matmul/SDPA.

KV cache layout per layer: (num_blocks, nkv, block_size, hd), so that one gather over
the (block, kv head) pairs of a block table yields (nkv, L, hd) with no further copy.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.models.attention import AttentionBackend, BatchLayout


@dataclass
class PrefillSpan:
    start: int  # first query token in the flat batch
    end: int
    context_len: int
    gather_index: torch.Tensor | None  # (nkv, nblk) rows of the cache; None: no cached prefix
    mask: torch.Tensor | None  # (Lq, context_len) bool, True where a key is visible


@dataclass
class TorchAttentionMetadata:
    slot_blocks: torch.Tensor  # (T,)
    slot_offsets: torch.Tensor  # (T,)
    num_decodes: int
    decode_gather_index: torch.Tensor | None  # (D, nkv, nblk)
    decode_mask: torch.Tensor | None  # (D, 1, 1, nblk * block_size) additive, float32
    prefills: list[PrefillSpan]


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def build_metadata(
        self, layout: BatchLayout, num_kv_heads: int, device: torch.device
    ) -> TorchAttentionMetadata:
        bs = layout.block_size
        slots = torch.tensor(layout.slot_mapping, dtype=torch.long)
        heads = torch.arange(num_kv_heads)
        d = layout.num_decodes
        decode_index = decode_mask = None
        if d:
            nblk = max((layout.context_lens[i] + bs - 1) // bs for i in range(d))
            table = torch.zeros(d, nblk, dtype=torch.long)
            for i in range(d):
                row = layout.block_tables[i][:nblk]
                table[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            decode_index = table[:, None, :] * num_kv_heads + heads[None, :, None]
            lens = torch.tensor(layout.context_lens[:d])
            hidden = torch.arange(nblk * bs)[None, :] >= lens[:, None]  # (D, L)
            decode_mask = torch.zeros(d, 1, 1, nblk * bs).masked_fill_(
                hidden[:, None, None, :], float("-inf")
            )
        prefills = []
        start = d
        for i in range(d, len(layout.query_lens)):
            q_len, ctx = layout.query_lens[i], layout.context_lens[i]
            index = mask = None
            if ctx > q_len:
                nblk = (ctx + bs - 1) // bs
                table = torch.tensor(layout.block_tables[i][:nblk], dtype=torch.long)
                index = (table[None, :] * num_kv_heads + heads[:, None]).to(device)
                q_pos = torch.arange(ctx - q_len, ctx)[:, None]
                mask = (torch.arange(ctx)[None, :] <= q_pos).to(device)
            prefills.append(PrefillSpan(start, start + q_len, ctx, index, mask))
            start += q_len
        return TorchAttentionMetadata(
            slot_blocks=(slots // bs).to(device),
            slot_offsets=(slots % bs).to(device),
            num_decodes=d,
            decode_gather_index=None if decode_index is None else decode_index.to(device),
            decode_mask=None if decode_mask is None else decode_mask.to(device),
            prefills=prefills,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache[metadata.slot_blocks, :, metadata.slot_offsets] = k
        v_cache[metadata.slot_blocks, :, metadata.slot_offsets] = v
        outputs = []
        if metadata.num_decodes:
            outputs.append(
                self._decode(q[: metadata.num_decodes], k_cache, v_cache, metadata, scale)
            )
        for span in metadata.prefills:
            outputs.append(self._prefill(q, k, v, k_cache, v_cache, span, scale))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        d, nh, hd = q.shape
        nkv, bs = k_cache.shape[1], k_cache.shape[2]
        index = meta.decode_gather_index
        length = index.shape[-1] * bs
        keys = k_cache.view(-1, bs, hd)[index].view(d, nkv, length, hd)
        values = v_cache.view(-1, bs, hd)[index].view(d, nkv, length, hd)
        q = q.view(d, nkv, nh // nkv, hd)  # query heads grouped by the kv head they share
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # (D, nkv, G, L)
        probs = torch.softmax(scores + meta.decode_mask, dim=-1).to(q.dtype)
        return torch.matmul(probs, values).view(d, nh, hd)

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        span: PrefillSpan,
        scale: float,
    ) -> torch.Tensor:
        qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # (1, nh, Lq, hd)
        if span.gather_index is None:
            ks = k[span.start : span.end].transpose(0, 1).unsqueeze(0)  # (1, nkv, Lq, hd)
            vs = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            nkv, bs, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
            ctx = span.context_len
            ks = k_cache.view(-1, bs, hd)[span.gather_index].view(nkv, -1, hd)[:, :ctx]
            vs = v_cache.view(-1, bs, hd)[span.gather_index].view(nkv, -1, hd)[:, :ctx]
            out = F.scaled_dot_product_attention(
                qs,
                ks.unsqueeze(0),
                vs.unsqueeze(0),
                attn_mask=span.mask,
                scale=scale,
                enable_gqa=True,
            )
        return out[0].transpose(0, 1)  # (Lq, nh, hd)
