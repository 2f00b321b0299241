"""Paged attention on torch: SDPA for prefills, a C++ kernel for decodes on CPU.

KV cache layout per layer: (num_blocks, nkv, block_size, hd). Decodes read their blocks
in place through the C++ kernel (app/models/cpu_kernels) when it builds; otherwise, and
on GPU, one gather over the (block, kv head) pairs of each block table yields
(nkv, L, hd) with no further copy, followed by two matmuls.
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
    slots: torch.Tensor  # (T,) int64
    slot_blocks: torch.Tensor  # (T,)
    slot_offsets: torch.Tensor  # (T,)
    num_decodes: int
    decode_tables: torch.Tensor | None  # (D, nblk) int32, for the C++ kernel
    decode_lens: torch.Tensor | None  # (D,) int32
    decode_gather_index: torch.Tensor | None  # (D, nkv, nblk), for the torch path
    decode_mask: torch.Tensor | None  # (D, 1, 1, nblk * block_size) additive, float32
    prefills: list[PrefillSpan]


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.kernels = None
        if device.type == "cpu":
            from app.models import cpu_kernels

            self.kernels = cpu_kernels.load()

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
        decode_index = decode_mask = decode_tables = decode_lens = None
        if d:
            nblk = max((layout.context_lens[i] + bs - 1) // bs for i in range(d))
            rows = [t[:nblk] + [0] * (nblk - len(t[:nblk])) for t in layout.block_tables[:d]]
            lens = torch.tensor(layout.context_lens[:d], dtype=torch.int32)
            if self.kernels is not None:
                decode_tables = torch.tensor(rows, dtype=torch.int32)
                decode_lens = lens
            else:
                table = torch.tensor(rows, dtype=torch.long)
                decode_index = (table[:, None, :] * num_kv_heads + heads[None, :, None]).to(device)
                hidden = torch.arange(nblk * bs)[None, :] >= lens[:, None]  # (D, L)
                decode_mask = (
                    torch.zeros(d, 1, 1, nblk * bs)
                    .masked_fill_(hidden[:, None, None, :], float("-inf"))
                    .to(device)
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
            slots=slots.to(device),
            slot_blocks=(slots // bs).to(device),
            slot_offsets=(slots % bs).to(device),
            num_decodes=d,
            decode_tables=decode_tables,
            decode_lens=decode_lens,
            decode_gather_index=decode_index,
            decode_mask=decode_mask,
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
        kernels = self.kernels
        if kernels is not None:
            kernels.write_kv_cache(k, v, k_cache, v_cache, metadata.slots)
        else:
            k_cache[metadata.slot_blocks, :, metadata.slot_offsets] = k
            v_cache[metadata.slot_blocks, :, metadata.slot_offsets] = v
        outputs = []
        d = metadata.num_decodes
        if d and kernels is not None:
            outputs.append(
                kernels.paged_decode_attention(
                    q[:d].contiguous(),
                    k_cache,
                    v_cache,
                    metadata.decode_tables,
                    metadata.decode_lens,
                    scale,
                )
            )
        elif d:
            outputs.append(self._decode(q[:d], k_cache, v_cache, metadata, scale))
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
