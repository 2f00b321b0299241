"""Paged attention with FlashAttention-2 kernels (CUDA, `pip install shoal[gpu]`).

KV cache layout per layer: (num_blocks, block_size, nkv, hd), FlashAttention's paged
layout. Each step writes its new keys and values into their slots first, then:

- decodes (one query token each): `flash_attn_with_kvcache` over each sequence's block
  table, `cache_seqlens` = its cached tokens including this one;
- prefill chunks: `flash_attn_varlen_func` with the block table, so a chunk after a
  cached prefix (prefix caching, a forked context, chunked prefill) attends to it in
  place; FlashAttention aligns the causal mask bottom-right, which is what a chunk whose
  keys run past its queries needs.

A sliding window is FlashAttention's `window_size=(window - 1, 0)`: a query at p sees
keys p - window + 1 .. p; a logit softcap is its `softcap` (flash-attn >= 2.6). Neither
argument is passed when off, so older flash-attn releases still serve other models.

FlashAttention-2's paged kernels need blocks of a multiple of 256 tokens; the engine
falls back to the torch backend (app/models/torch_attention.py) for other block sizes.
The two kernels are attributes so the layout and metadata can be checked on the CPU
against reference implementations (tests/models/test_flash_attention.py).
"""

from dataclasses import dataclass
from typing import Any

import torch

from app.models.attention import AttentionBackend, BatchLayout

PAGE_MULTIPLE = 256  # FlashAttention-2: page_block_size % 256 == 0


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@dataclass
class FlashMetadata:
    slots: torch.Tensor  # (T,) int64 cache slot of each query token
    num_decodes: int
    decode_tables: torch.Tensor | None = None  # (D, nblk) int32
    decode_lens: torch.Tensor | None = None  # (D,) int32
    prefill_tables: torch.Tensor | None = None  # (P, nblk) int32
    cu_q: torch.Tensor | None = None  # (P + 1,) int32
    cu_k: torch.Tensor | None = None  # (P + 1,) int32
    max_q: int = 0
    max_k: int = 0


def _cumulative(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


class FlashAttentionBackend(AttentionBackend):
    name = "flash"

    def __init__(self, block_size: int, kernels: Any = None) -> None:
        if block_size % PAGE_MULTIPLE:
            raise ValueError(
                f"FlashAttention's paged kernels need block_size a multiple of {PAGE_MULTIPLE}, "
                f"got {block_size}"
            )
        if kernels is None:
            import flash_attn

            kernels = flash_attn
        self.varlen = kernels.flash_attn_varlen_func
        self.with_kvcache = kernels.flash_attn_with_kvcache

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(
        self, layout: BatchLayout, num_kv_heads: int, device: torch.device
    ) -> FlashMetadata:
        pin = device.type == "cuda"  # pinned host memory: the copies below do not block

        def to_device(values: list | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            host = torch.as_tensor(values, dtype=dtype)
            return (host.pin_memory() if pin else host).to(device, non_blocking=True)

        d, total = layout.num_decodes, len(layout.query_lens)
        meta = FlashMetadata(to_device(layout.slot_mapping, torch.long), d)
        if d:
            lens = layout.context_lens[:d]
            meta.decode_tables = to_device(layout.tables(0, d), torch.int32)
            meta.decode_lens = to_device(lens, torch.int32)
        if total > d:
            q_lens, lens = layout.query_lens[d:], layout.context_lens[d:]
            meta.prefill_tables = to_device(layout.tables(d, total), torch.int32)
            meta.cu_q = to_device(_cumulative(q_lens), torch.int32)
            meta.cu_k = to_device(_cumulative(lens), torch.int32)
            meta.max_q, meta.max_k = max(q_lens), max(lens)
        return meta

    def decode_metadata(
        self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
    ) -> FlashMetadata:
        """The static tensors as they are: `flash_attn_with_kvcache` reads each row of a
        full-width table only up to its `cache_seqlens`, and splits by shapes alone."""
        return FlashMetadata(slots, slots.shape[0], decode_tables=tables, decode_lens=lens)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: FlashMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        nkv, hd = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, nkv, hd).index_copy_(0, metadata.slots, k)
        v_cache.view(-1, nkv, hd).index_copy_(0, metadata.slots, v)
        d, outputs = metadata.num_decodes, []
        extra: dict[str, Any] = {}
        if window > 0:
            extra["window_size"] = (window - 1, 0)
        if softcap > 0:
            extra["softcap"] = softcap
        if d:
            out = self.with_kvcache(
                q[:d].unsqueeze(1),  # (D, 1, nh, hd)
                k_cache,
                v_cache,
                cache_seqlens=metadata.decode_lens,
                block_table=metadata.decode_tables,
                softmax_scale=scale,
                causal=True,
                **extra,
            )
            outputs.append(out.squeeze(1))
        if metadata.cu_q is not None:
            outputs.append(
                self.varlen(
                    q[d:],
                    k_cache,
                    v_cache,
                    cu_seqlens_q=metadata.cu_q,
                    cu_seqlens_k=metadata.cu_k,
                    max_seqlen_q=metadata.max_q,
                    max_seqlen_k=metadata.max_k,
                    softmax_scale=scale,
                    causal=True,
                    block_table=metadata.prefill_tables,
                    **extra,
                )
            )
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
