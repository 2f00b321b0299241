"""Paged attention for CPU (C++ kernels) with a plain-torch path for everything else.

KV cache layout per layer: (num_blocks, nkv, block_size, hd).

- CPU with the kernels built (app/models/cpu_kernels): decodes and prefill chunks read
  their keys and values in place from the blocks named by each block table.
- Otherwise (no compiler, or a GPU without FlashAttention): one gather over the
  (block, kv head) pairs of each block table yields (nkv, L, hd) with no further copy;
  decodes then use two matmuls, prefills SDPA (two matmuls too under a softcap, which
  SDPA cannot apply). A sliding window is a mask here, built once per window and forward;
  the kernels skip the blocks before it instead.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from app.models.attention import AttentionBackend, BatchLayout, DecodeInputs
from app.models.prefill_spans import PrefillSpan, visible_keys


@dataclass
class KernelBatch:
    """Inputs of the C++ kernels for one group of sequences."""

    tables: torch.Tensor  # (S, nblk) int32, padded with 0
    lens: torch.Tensor  # (S,) int32: cached tokens including this step's
    starts: torch.Tensor | None = None  # (S + 1,) int32 query offsets, prefills only


@dataclass
class TorchAttentionMetadata:
    slots: torch.Tensor  # (T,) int64
    num_decodes: int
    slot_blocks: torch.Tensor | None = None  # (T,) torch path
    slot_offsets: torch.Tensor | None = None  # (T,) torch path
    kernel_decode: KernelBatch | None = None
    kernel_prefill: KernelBatch | None = None
    decode_gather_index: torch.Tensor | None = None  # (D, nkv, nblk), torch path
    decode_lens: torch.Tensor | None = None  # (D,) int64, torch path
    decode_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # by window, torch path
    prefills: list[PrefillSpan] | None = None  # torch path

    def decode_mask(self, window: int, block_size: int) -> torch.Tensor:
        """(D, 1, 1, L) additive float32: -inf on keys a decode must not see."""
        if window not in self.decode_masks:
            length = self.decode_gather_index.shape[-1] * block_size
            seen = visible_keys(self.decode_lens - 1, length, window)
            mask = torch.zeros(seen.shape, device=seen.device).masked_fill_(~seen, float("-inf"))
            self.decode_masks[window] = mask[:, None, None, :]
        return self.decode_masks[window]


class TorchPagedAttention(AttentionBackend):
    name = "torch"
    sees_both_ways = True  # such a step's prefills take the masked torch path

    def __init__(self, device: torch.device) -> None:
        # With the kernels, prefill queries too attend one token at a time through the
        # decode kernel: a token's attention is then the same bits whether it came in a
        # prompt, a prefill chunk after a cached prefix or a decode (the loader sets it for
        # quantized models, whose int8 activations turn any difference into a visible one).
        self.token_by_token = False
        self.kernels = None
        if device.type == "cpu":
            from app.models import cpu_kernels

            self.kernels = cpu_kernels.load()

    @property
    def has_prefill_kernel(self) -> bool:
        return self.kernels is not None and self.kernels.has_prefill_kernel()

    @property
    def reads_16_bit_cache_fast(self) -> bool:
        """Whether a float16 or bfloat16 cache is read in vector registers (AVX-512 or
        AVX2 kernels), which then read half the bytes of a float32 one."""
        return self.kernels is not None and self.kernels.reads_16_bit_cache_fast()

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, head_dim)

    # ---- metadata -------------------------------------------------------------------
    def build_metadata(
        self, layout: BatchLayout, num_kv_heads: int, device: torch.device
    ) -> TorchAttentionMetadata:
        bs, slots = layout.block_size, layout.slot_mapping
        meta = TorchAttentionMetadata(slots.to(device), layout.num_decodes)
        if self.kernels is None:
            meta.slot_blocks, meta.slot_offsets = (slots // bs).to(device), (slots % bs).to(device)
        d, total = layout.num_decodes, len(layout.query_lens)
        # Prefills that see an image both ways come last (the input batch orders them so)
        # and take the torch path: the C++ kernels' masks are causal only.
        masked = min((i for i, _, _ in layout.both_ways), default=total)
        first = total  # the torch path's prefills: [first, total)
        if self.kernels is not None and self.token_by_token and total > d:
            if masked:
                meta.kernel_decode = self._token_batch(layout, masked)
            meta.num_decodes, first = sum(layout.query_lens[:masked]), masked
        else:
            if d and self.kernels is not None:
                meta.kernel_decode = self._kernel_batch(layout, 0, d)
            elif d:
                self._torch_decode(meta, layout, num_kv_heads, device)
            first = masked if self.has_prefill_kernel else d
            if first > d:
                meta.kernel_prefill = self._kernel_batch(layout, d, first, with_starts=True)
        if first < total:
            meta.prefills = self._torch_prefills(layout, first, num_kv_heads, device)
        return meta

    def decode_metadata(
        self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
    ) -> TorchAttentionMetadata:
        """With the C++ kernels only: the gathers of the torch path would read every
        block of a full-width static table, whatever the contexts' lengths."""
        if self.kernels is None:
            raise NotImplementedError("the torch backend's gathers need per-step tables")
        return TorchAttentionMetadata(slots, len(slots), kernel_decode=KernelBatch(tables, lens))

    def decode_inputs(self, metadata: TorchAttentionMetadata) -> DecodeInputs | None:
        kb = metadata.kernel_decode
        if kb is None or metadata.num_decodes != metadata.slots.shape[0]:
            return None
        return DecodeInputs(metadata.slots, kb.tables, kb.lens)

    @staticmethod
    def _token_batch(layout: BatchLayout, hi: int) -> KernelBatch:
        """Every query token of sequences [0, hi) as a decode of its own: its sequence's
        table, and the keys up to its position."""
        counts = torch.tensor(layout.query_lens[:hi])
        tables = layout.block_tables[:hi].repeat_interleave(counts, dim=0)
        ends = torch.tensor(layout.context_lens[:hi]).repeat_interleave(counts)
        firsts = torch.cumsum(counts, 0).repeat_interleave(counts)  # one past each's last
        lens = ends - (firsts - torch.arange(len(ends)) - 1)  # ctx - n + 1 .. ctx
        return KernelBatch(tables, lens.int())

    @staticmethod
    def _kernel_batch(
        layout: BatchLayout, lo: int, hi: int, with_starts: bool = False
    ) -> KernelBatch:
        starts = None
        if with_starts:
            offsets = [0]
            for n in layout.query_lens[lo:hi]:
                offsets.append(offsets[-1] + n)
            starts = torch.tensor(offsets, dtype=torch.int32)
        lens = torch.tensor(layout.context_lens[lo:hi], dtype=torch.int32)
        return KernelBatch(layout.tables(lo, hi), lens, starts)

    @staticmethod
    def _torch_decode(
        meta: TorchAttentionMetadata, layout: BatchLayout, nkv: int, device: torch.device
    ) -> None:
        d = layout.num_decodes
        table = layout.tables(0, d).long()
        meta.decode_gather_index = (table[:, None, :] * nkv + torch.arange(nkv)[None, :, None]).to(
            device
        )
        meta.decode_lens = torch.tensor(layout.context_lens[:d]).to(device)

    @staticmethod
    def _torch_prefills(
        layout: BatchLayout, first: int, nkv: int, device: torch.device
    ) -> list[PrefillSpan]:
        bs, spans, start = layout.block_size, [], sum(layout.query_lens[:first])
        for i in range(first, len(layout.query_lens)):
            q_len, ctx = layout.query_lens[i], layout.context_lens[i]
            index = None
            if ctx > q_len:
                table = layout.block_tables[i, : (ctx + bs - 1) // bs].long()
                index = (table[None, :] * nkv + torch.arange(nkv)[:, None]).to(device)
            both = layout.both_ways_of(i)
            spans.append(PrefillSpan(start, start + q_len, ctx, index, device, both))
            start += q_len
        return spans

    # ---- attention ------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        kernels, d = self.kernels, metadata.num_decodes
        if kernels is not None:
            kernels.write_kv_cache(k, v, k_cache, v_cache, metadata.slots)
        else:
            # The cache may hold 16 bits under a float32 model (kv_cache_dtype).
            k_cache[metadata.slot_blocks, :, metadata.slot_offsets] = k.to(k_cache.dtype)
            v_cache[metadata.slot_blocks, :, metadata.slot_offsets] = v.to(v_cache.dtype)
        outputs = []
        if metadata.kernel_decode is not None:
            kb = metadata.kernel_decode
            outputs.append(
                kernels.paged_decode_attention(
                    q[:d].contiguous(), k_cache, v_cache, kb.tables, kb.lens, scale, window, softcap
                )
            )
        elif d:
            outputs.append(self._decode(q[:d], k_cache, v_cache, metadata, scale, window, softcap))
        if metadata.kernel_prefill is not None:
            kb = metadata.kernel_prefill
            outputs.append(
                kernels.paged_prefill_attention(
                    q[d : d + int(kb.starts[-1])].contiguous(),
                    k_cache,
                    v_cache,
                    kb.tables,
                    kb.lens,
                    kb.starts,
                    scale,
                    window,
                    softcap,
                )
            )
        for span in metadata.prefills or ():
            outputs.append(self._prefill(q, k, v, k_cache, v_cache, span, scale, window, softcap))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        scale: float,
        window: int,
        softcap: float,
    ) -> torch.Tensor:
        d, nh, hd = q.shape
        nkv, bs = k_cache.shape[1], k_cache.shape[2]
        index = meta.decode_gather_index
        length = index.shape[-1] * bs
        keys = k_cache.view(-1, bs, hd)[index].view(d, nkv, length, hd).to(q.dtype)
        values = v_cache.view(-1, bs, hd)[index].view(d, nkv, length, hd).to(q.dtype)
        q = q.view(d, nkv, nh // nkv, hd)  # query heads grouped by the kv head they share
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # (D, nkv, G, L)
        if softcap > 0:
            scores.div_(softcap).tanh_().mul_(softcap)
        probs = torch.softmax(scores + meta.decode_mask(window, bs), dim=-1).to(q.dtype)
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
        window: int,
        softcap: float,
    ) -> torch.Tensor:
        ctx = span.context_len
        if window >= ctx:  # every query already sees all its keys: the window changes nothing
            window = 0
        qs = q[span.start : span.end].transpose(0, 1)  # (nh, Lq, hd)
        if span.gather_index is None:  # no cached prefix: the chunk's own keys are all
            ks = k[span.start : span.end].transpose(0, 1)  # (nkv, Lq, hd)
            vs = v[span.start : span.end].transpose(0, 1)
            if k_cache.dtype != q.dtype:  # rounded as the cache holds them, as later reads
                ks, vs = ks.to(k_cache.dtype).to(q.dtype), vs.to(v_cache.dtype).to(q.dtype)
            if window == 0 and softcap == 0 and not span.both_ways:
                out = F.scaled_dot_product_attention(
                    qs[None], ks[None], vs[None], is_causal=True, scale=scale, enable_gqa=True
                )
                return out[0].transpose(0, 1)  # (Lq, nh, hd)
        else:
            nkv, bs, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
            ks = k_cache.view(-1, bs, hd)[span.gather_index].view(nkv, -1, hd)[:, :ctx].to(q.dtype)
            vs = v_cache.view(-1, bs, hd)[span.gather_index].view(nkv, -1, hd)[:, :ctx].to(q.dtype)
        mask = span.mask(window)
        if softcap > 0:
            return _softcapped_attention(qs, ks, vs, mask, scale, softcap).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            qs[None], ks[None], vs[None], attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out[0].transpose(0, 1)


SOFTCAP_SCORE_BYTES = 64 << 20


def _softcapped_attention(
    q: torch.Tensor,  # (nh, Lq, hd)
    k: torch.Tensor,  # (nkv, L, hd)
    v: torch.Tensor,
    mask: torch.Tensor,  # (Lq, L) bool
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Attention with capped scores, which SDPA cannot apply; returns (nh, Lq, hd).
    Scores are float32 products, as in SDPA: rounded to bf16 they lose up to 1/256 of
    themselves, a few hundredths at the magnitudes a cap of 30 or 50 allows."""
    nh, lq, hd = q.shape
    length = k.shape[1]
    # Query tiles bound the float32 scores however long the context.
    tile = max(1, SOFTCAP_SCORE_BYTES // (4 * nh * length))
    if lq > tile:
        parts = [
            _softcapped_attention(q[:, i : i + tile], k, v, mask[i : i + tile], scale, softcap)
            for i in range(0, lq, tile)
        ]
        return torch.cat(parts, dim=1)
    nkv = k.shape[0]
    qg = q.reshape(nkv, nh // nkv * lq, hd)  # query heads grouped by the kv head they share
    scores = torch.matmul(qg.float(), k.float().transpose(-1, -2))
    scores.mul_(scale / softcap).tanh_().mul_(softcap)  # in place: these are big
    scores = scores.view(nkv, nh // nkv, lq, length).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs.view(nkv, -1, length), v).view(nh, lq, hd)
