"""Paged attention with Triton kernels (app/models/triton_kernels): the GPU backend where
FlashAttention cannot serve (not installed, or a block size that is not a multiple of
256), and the one whose decode step a CUDA graph can capture (`decode_metadata`).

KV cache layout per layer: (num_blocks, nkv, block_size, hd), the torch backend's, so
`copy_blocks`, slot files and the torch reference all apply unchanged. A 16-bit cache
under a float32 model is read as float32 (the kernels widen every load).

Each forward writes the step's keys and values into their slots, then attends: decodes
(split over the context, flash-decoding) into the first rows of one output, prefill
chunks (each the last tokens of its context, so a chunk after a cached prefix reads the
prefix in place) into the rest. On the CPU the kernels run only under Triton's
interpreter (TRITON_INTERPRET=1): for tests, far too slow to serve.
"""

from dataclasses import dataclass

import torch

from app.models.attention import AttentionBackend, BatchLayout


@dataclass
class TritonMetadata:
    slots: torch.Tensor  # (T,) int64 cache slot of each query token
    num_decodes: int
    decode_tables: torch.Tensor | None = None  # (D, nblk) int32; read up to each length
    decode_lens: torch.Tensor | None = None  # (D,) int32 cached tokens including this one
    prefill_tables: torch.Tensor | None = None  # (P, nblk) int32; read up to each length
    prefill_lens: torch.Tensor | None = None  # (P,) int32 context lengths
    prefill_starts: torch.Tensor | None = None  # (P + 1,) int32 query offsets in q[D:]
    max_query_len: int = 0  # the longest prefill chunk: the prefill grid's height


def _offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


class TritonPagedAttention(AttentionBackend):
    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        # Imported here, not at the top: the engine imports this module on machines
        # without triton (model_runner checks a backend's class).
        from app.models import triton_kernels

        self.kernels = triton_kernels
        # Decode partitions per (sequence, kv head). None: chosen per launch from the
        # batch size and the GPU (triton_kernels.decode_splits); tests force a count.
        self.num_splits = num_splits

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def build_metadata(
        self, layout: BatchLayout, num_kv_heads: int, device: torch.device
    ) -> TritonMetadata:
        pin = device.type == "cuda"  # pinned host memory: the copies below do not block

        def to_device(values: list | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            host = torch.as_tensor(values, dtype=dtype)
            return (host.pin_memory() if pin else host).to(device, non_blocking=True)

        d, total = layout.num_decodes, len(layout.query_lens)
        meta = TritonMetadata(to_device(layout.slot_mapping, torch.long), d)
        if d:
            meta.decode_tables = to_device(layout.tables(0, d), torch.int32)
            meta.decode_lens = to_device(layout.context_lens[:d], torch.int32)
        if total > d:
            q_lens = layout.query_lens[d:]
            meta.prefill_tables = to_device(layout.tables(d, total), torch.int32)
            meta.prefill_lens = to_device(layout.context_lens[d:], torch.int32)
            meta.prefill_starts = to_device(_offsets(q_lens), torch.int32)
            meta.max_query_len = max(q_lens)
        return meta

    def decode_metadata(
        self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
    ) -> TritonMetadata:
        # The tensors as they are: the decode grid and buffers depend on the batch size
        # alone (not on the tables' width, nor on any value), so a graph can capture it.
        return TritonMetadata(slots, slots.shape[0], decode_tables=tables, decode_lens=lens)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        kernels = self.kernels
        kernels.write_kv_cache(k, v, k_cache, v_cache, metadata.slots)
        d = metadata.num_decodes
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (T, nh, hd)
        if d:
            kernels.paged_decode_attention(
                q[:d],
                k_cache,
                v_cache,
                metadata.decode_tables,
                metadata.decode_lens,
                scale,
                window,
                softcap,
                out[:d],
                self.num_splits,
            )
        if metadata.prefill_starts is not None:
            kernels.paged_prefill_attention(
                q[d:],
                k_cache,
                v_cache,
                metadata.prefill_tables,
                metadata.prefill_lens,
                metadata.prefill_starts,
                metadata.max_query_len,
                scale,
                window,
                softcap,
                out[d:],
            )
        return out
