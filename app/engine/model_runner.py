"""ModelRunner: owns the model and its KV cache; turns a scheduled batch into logits."""

import logging

import torch

from app.engine.config import EngineConfig
from app.engine.scheduler import ScheduledBatch
from app.engine.sequence import Sequence
from app.models.attention import AttentionBackend, BatchLayout
from app.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    arch = model.arch
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype.itemsize
    return per_token * block_size


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = config.block_size
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        arch = model.arch
        shape = backend.kv_cache_shape(
            num_blocks, config.block_size, arch.num_kv_heads, arch.head_dim
        )
        self.num_kv_heads = arch.num_kv_heads
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        for _ in model.model.layers:
            self.k_caches.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
            self.v_caches.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
        logger.info(
            "KV cache: %d blocks of %d tokens, %s per layer", num_blocks, self.block_size, shape
        )

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one forward pass. Returns logits (S, vocab) in the model's dtype on the CPU
        for the sequences whose next token is due (prompts fully computed), in that order."""
        self._bind_caches()
        if batch.copies:
            self._copy_blocks(batch)
        order = sorted(range(len(batch)), key=lambda i: batch.num_new_tokens[i] != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, tables = [], [], []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        bs = self.block_size
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            context_lens.append(end)
            tables.append(table)
            if end == seq.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        num_decodes = sum(1 for n in query_lens if n == 1)
        layout = BatchLayout(query_lens, context_lens, tables, slots, num_decodes, bs)
        metadata = self.backend.build_metadata(layout, self.num_kv_heads, self.device)
        dev = self.device
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            metadata,
            torch.tensor(logits_rows, dtype=torch.long, device=dev),
        )
        return logits.cpu(), sampled

    def _bind_caches(self) -> None:
        # Bound per run (30 attribute stores) so engines may share one model's weights.
        for layer, k, v in zip(self.model.model.layers, self.k_caches, self.v_caches, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v

    def _copy_blocks(self, batch: ScheduledBatch) -> None:
        src = torch.tensor([c.src for c in batch.copies], device=self.device)
        dst = torch.tensor([c.dst for c in batch.copies], device=self.device)
        for k, v in zip(self.k_caches, self.v_caches, strict=True):
            self.backend.copy_blocks(k, v, src, dst)
