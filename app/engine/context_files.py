"""ContextFiles: a context's tokens and KV written to a file, and read back into a context
(llama.cpp's slot save and restore; the file format is app.engine.slot_files').

Only the copy of a context's blocks (save) or their install (restore) holds the engine's
lock; the file is written or read outside it. Callers therefore run these off the step
loop, in a worker thread, so that a multi-GB file never stalls a step, and one at a time,
so that a save's quota check sees the file of the save before it.

A file fits only an engine of the same model and cache layout (its fingerprint), and with
tensor parallelism each shard holds part of the KV: saving and restoring need
tensor_parallel_size 1.
"""

from pathlib import Path
from typing import Any

from app.engine import slot_files
from app.engine.engine import LLMEngine
from app.engine.sequence import Sequence
from app.engine.validation import checked_token_ids
from app.protocol.errors import (
    CapacityError,
    ConflictError,
    InvalidRequestError,
    NotImplementedByServerError,
)
from app.protocol.outputs import ContextFile
from app.protocol.sampling import SamplingParams


class ContextFiles:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        runner = engine.runner
        k = runner.k_caches[0]  # (blocks, *block shape) for every layer, K and V alike
        self.num_layers = len(runner.k_caches)
        self.block_shape = tuple(k.shape[1:])
        self.bytes_per_block = 2 * self.num_layers * k[0].numel() * k.element_size()
        local = runner.model.local  # this shard's heads
        self.fingerprint: dict[str, Any] = {
            "model": engine.source.name,
            "layers": local.num_layers,
            "kv_heads": local.num_kv_heads,
            "head_dim": local.head_dim,
            "dtype": str(runner.dtype),
            "block_size": engine.config.block_size,
            "cache_shape": list(self.block_shape),
        }
        if runner.kv_dtype != runner.dtype:  # files of a same-dtype cache stay as before
            self.fingerprint["kv_dtype"] = str(runner.kv_dtype)
        # A file larger than a whole context of this model could be is refused unread.
        n = engine.max_model_len
        blocks = engine.block_manager.blocks_needed(n)
        self.max_file_bytes = blocks * self.bytes_per_block + 64 * n + (1 << 20)

    def save(self, context_id: str, path: str, quota_bytes: int | None = None) -> ContextFile:
        """Write a context's tokens and the KV of its computed ones to `path`. With
        `quota_bytes`, the files in `path`'s directory may not pass it (409)."""
        self._single_shard("save")
        engine = self.engine
        with engine.lock:
            ctx = engine.contexts.get(context_id)
            if ctx.busy_with is not None:
                raise ConflictError(f"context {context_id!r} is busy")
            holder = ctx.holder
            computed = holder.num_computed_tokens
            blocks = holder.block_table[: engine.block_manager.blocks_needed(computed)]
            tokens = list(holder.token_ids)
            if quota_bytes is not None:
                estimate = len(blocks) * self.bytes_per_block + 16 * len(tokens)
                slot_files.check_quota(Path(path), estimate, quota_bytes)
            kv = engine.runner.read_blocks(blocks)
        num_bytes = slot_files.save(Path(path), self.fingerprint, tokens, computed, kv)
        return ContextFile(num_tokens=len(tokens), num_bytes=num_bytes)

    def restore(self, context_id: str, path: str) -> ContextFile:
        """Make the file at `path` the context `context_id`, replacing an idle one of that
        id (a busy one: 409). Idle contexts give up their KV to make room (else 429)."""
        self._single_shard("restore")
        loaded = slot_files.load(Path(path), self.fingerprint, self.max_file_bytes)
        self._check(loaded, Path(path).name)
        engine, bm = self.engine, self.engine.block_manager
        with engine.lock:
            holder = Sequence(f"context:{context_id}", loaded.tokens, SamplingParams())
            if not bm.can_append(holder, loaded.computed):
                engine.contexts.evict_kv(bm.blocks_to_append(holder, loaded.computed))
            if not bm.can_append(holder, loaded.computed):
                raise CapacityError("not enough free KV cache blocks to restore it now")
            bm.append_slots(holder, loaded.computed)
            engine.runner.write_blocks(holder.block_table, loaded.kv)
            holder.num_computed_tokens = loaded.computed
            bm.register_computed(holder)
            try:
                engine.contexts.adopt(context_id, holder)
            except BaseException:
                bm.free(holder)
                raise
        return ContextFile(num_tokens=len(loaded.tokens), num_bytes=loaded.num_bytes)

    def _check(self, loaded: slot_files.SlotFile, name: str) -> None:
        """What the fingerprint cannot say: the tokens fit this model, the KV its cache."""
        engine = self.engine
        checked_token_ids(loaded.tokens, engine.arch.vocab_size, "filename")
        if len(loaded.tokens) > engine.max_model_len:
            raise InvalidRequestError(
                f"the slot in {name!r} holds {len(loaded.tokens)} tokens, more than the "
                f"model's context of {engine.max_model_len}",
                param="filename",
            )
        nblocks = engine.block_manager.blocks_needed(loaded.computed)
        if tuple(loaded.kv.shape) != (self.num_layers, 2, nblocks, *self.block_shape):
            raise InvalidRequestError(f"the KV in {name!r} has the wrong shape")

    def _single_shard(self, action: str) -> None:
        if self.engine.runner.model.tp.enabled:
            raise NotImplementedByServerError(
                f"slot {action} needs tensor_parallel_size 1 (each shard holds part of the KV)"
            )
