"""LLMEngine: add_request / step / abort over the scheduler, model runner and sampler.

One step reads like the design: schedule -> run the model -> sample -> append tokens.
The engine is single-stepped by one thread; `add_request` and `abort` may be called
from others (they take the lock, which a step releases while the model runs).
"""

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from app.engine import slot_files
from app.engine.block_manager import BlockManager
from app.engine.config import EngineConfig
from app.engine.contexts import ContextStore
from app.engine.model_runner import load_runner
from app.engine.sampler import Sampler
from app.engine.scheduler import Scheduler
from app.engine.sequence import Sequence
from app.engine.stats import EngineStats
from app.models.arch import ArchConfig
from app.models.loader import LoadedModel
from app.models.parallel import TPGroup
from app.protocol.errors import (
    CapacityError,
    ConflictError,
    InvalidRequestError,
    NotImplementedByServerError,
    ShoalError,
)
from app.protocol.messages import ContextAction, ContextOp
from app.protocol.outputs import (
    CompletionOutput,
    EngineErrorMessage,
    FinishReason,
    RequestOutput,
    TokenDelta,
    TokenLogprob,
)
from app.protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)

MAX_FAILED_FORWARDS = 3  # in a row: past this a forward failure is the engine's, not a batch's


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        tp: TPGroup = TPGroup(),  # noqa: B008 (frozen)
    ) -> None:
        """`loaded` reuses weights already in memory (another engine's, in tests); the
        KV cache is always this engine's own. With tensor parallelism this engine is
        rank 0 of `tp` (see app.engine.shard): it schedules and samples for every shard."""
        self.config = config
        torch.set_num_threads(config.threads)
        loaded, self.runner = load_runner(config, tp, loaded)
        self.loaded = loaded
        self.source = loaded.source
        self.arch: ArchConfig = loaded.arch
        self.max_model_len = loaded.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.contexts = ContextStore(
            self.block_manager, config.max_contexts, config.max_context_tokens
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            self.arch.eos_token_ids,
            reclaim=self.contexts.evict_kv,
        )
        self.sampler = Sampler(self.arch.vocab_size, self.arch.eos_token_ids, config.seed)
        self.requests: dict[str, list[Sequence]] = {}
        self._aborted: list[TokenDelta] = []  # deltas of requests ended between steps
        self._failed_forwards = 0  # in a row; past MAX_FAILED_FORWARDS the engine is broken
        self._stalled_since: float | None = None  # work waiting, nothing scheduled
        self.last_step_scheduled = False
        self._lock = threading.RLock()
        self.stats = EngineStats()
        self._refresh_stats()

    # ---- requests -----------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams
    ) -> None:
        """Queue a request; raises InvalidRequestError (or ContextLengthExceededError)
        when it can never be served."""
        prompt = self._checked_tokens(prompt_token_ids, "prompt")
        self._check_params(params)
        with self._lock:
            if request_id in self.requests:
                raise ConflictError(f"request id {request_id!r} is already in use")
            seq = Sequence(request_id, prompt, params, 0, time.monotonic())
            self.scheduler.add(seq)
            self.requests[request_id] = [seq]

    def add_context_request(
        self, request_id: str, op: ContextOp, new_token_ids: Seq[int], params: SamplingParams
    ) -> None:
        """A Fill or Generate on a persistent context (see app.engine.contexts). A Fill
        computes its tokens' KV and samples nothing the client sees."""
        tokens = self._checked_tokens(new_token_ids, "token_ids")
        if op.action is ContextAction.FILL:
            params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        self._check_params(params)
        with self._lock:
            if request_id in self.requests:
                raise ConflictError(f"request id {request_id!r} is already in use")
            seq = self.contexts.start(request_id, op, tokens, params)
            seq.arrival = time.monotonic()
            try:
                self.scheduler.add(seq)
            except BaseException:
                self.contexts.release(seq)
                raise
            self.requests[request_id] = [seq]

    def free_context(self, context_id: str) -> int:
        """Drop a context; returns how many tokens it held. A busy one is a ConflictError."""
        with self._lock:
            held = self.contexts.free(context_id)
            self._refresh_stats()
            return held

    def context_tokens(self, context_id: str) -> list[int]:
        with self._lock:
            return list(self.contexts.get(context_id).token_ids)

    # ---- slot files: a context's tokens and KV on disk ---------------------------------
    def fingerprint(self) -> dict:
        """What a saved KV cache must match to be restored here."""
        a = self.runner.model.local
        return {
            "model": self.source.name,
            "layers": a.num_layers,
            "kv_heads": a.num_kv_heads,
            "head_dim": a.head_dim,
            "dtype": str(self.config.torch_dtype),
            "block_size": self.config.block_size,
            "cache_shape": list(self.runner.k_caches[0].shape[1:]),
        }

    def kv_bytes_per_block(self) -> int:
        k = self.runner.k_caches[0]
        return 2 * len(self.runner.k_caches) * k[0].numel() * k.element_size()

    def save_context(self, context_id: str, path: str, quota_bytes: int | None = None) -> dict:
        """Write a context's tokens and KV to `path`. Only the copy of its blocks holds
        the engine's lock; the file is written after (callers run this off the step
        loop). With `quota_bytes`, the files in `path`'s directory may not pass it."""
        self._single_shard("save")
        with self._lock:
            ctx = self.contexts.get(context_id)
            if ctx.busy_with is not None:
                raise ConflictError(f"context {context_id!r} is busy", param="id_slot")
            holder = ctx.holder
            blocks = holder.block_table[
                : self.block_manager.blocks_needed(holder.num_computed_tokens)
            ]
            tokens, computed = list(holder.token_ids), holder.num_computed_tokens
            if quota_bytes is not None:
                estimate = len(blocks) * self.kv_bytes_per_block() + 16 * len(tokens)
                slot_files.check_quota(Path(path), estimate, quota_bytes)
            kv = self.runner.read_blocks(blocks)
        size = slot_files.save(Path(path), self.fingerprint(), tokens, computed, kv)
        return {"n_saved": len(tokens), "n_written": size}

    def restore_context(self, context_id: str, path: str) -> dict:
        """Load `path` (without the lock: callers run this off the step loop), then
        install its blocks. A file larger than a whole context of this model could be
        is refused before it is read."""
        self._single_shard("restore")
        max_bytes = (
            self.block_manager.blocks_needed(self.max_model_len) * self.kv_bytes_per_block()
            + 64 * self.max_model_len
            + (1 << 20)
        )
        tokens, computed, kv = slot_files.load(Path(path), self.fingerprint(), max_bytes)
        self._checked_tokens(tokens, "filename")
        if len(tokens) > self.max_model_len:
            raise InvalidRequestError(
                f"the slot in {Path(path).name!r} holds {len(tokens)} tokens, more than the "
                f"model's context of {self.max_model_len}",
                param="filename",
            )
        nblocks = self.block_manager.blocks_needed(computed)
        if tuple(kv.shape[2:]) != (nblocks, *self.runner.k_caches[0].shape[1:]) or kv.shape[:2] != (
            len(self.runner.k_caches),
            2,
        ):
            raise InvalidRequestError(f"the KV in {Path(path).name!r} has the wrong shape")
        with self._lock:
            holder = Sequence(f"context:{context_id}", tokens, SamplingParams())
            if not self.block_manager.can_append(holder, computed):
                self.contexts.evict_kv(self.block_manager.blocks_to_append(holder, computed))
            if not self.block_manager.can_append(holder, computed):
                raise CapacityError("not enough free KV cache blocks to restore it now")
            self.block_manager.append_slots(holder, computed)
            self.runner.write_blocks(holder.block_table, kv)
            holder.num_computed_tokens = computed
            self.block_manager.register_computed(holder)
            try:
                self.contexts.adopt(context_id, holder)
            except BaseException:
                self.block_manager.free(holder)
                raise
            self._refresh_stats()
        return {"n_restored": len(tokens)}

    def _single_shard(self, action: str) -> None:
        if self.runner.model.tp.enabled:
            raise NotImplementedByServerError(
                f"slot {action} needs tensor_parallel_size 1 (each shard holds part of the KV)"
            )

    def slots(self) -> list[dict]:
        """llama.cpp's view: `max_num_seqs` slots; each running or waiting sequence holds
        one (in admission order), the rest are idle."""
        with self._lock:
            busy = list(self.scheduler.running) + list(self.scheduler.waiting)
            slots = []
            for i in range(max(self.config.max_num_seqs, len(busy))):
                seq = busy[i] if i < len(busy) else None
                slot = {"id": i, "n_ctx": self.max_model_len, "is_processing": seq is not None}
                if seq is not None:
                    slot.update(
                        id_task=seq.request_id,
                        state="processing" if seq in self.scheduler.running else "waiting",
                        n_prompt_tokens=seq.num_prompt_tokens,
                        n_prompt_tokens_cached=seq.num_cached_tokens,
                        n_decoded=seq.num_output_tokens,
                        params=seq.params.model_dump(mode="json"),
                    )
                else:
                    slot["state"] = "idle"
                slots.append(slot)
            return slots

    def stats_snapshot(self) -> dict:
        """The stats, with the figures that cost a pass over the contexts (taken here,
        when asked, not after every step)."""
        with self._lock:
            s, c = self.stats, self.contexts
            s.num_contexts_resident, s.num_context_tokens = c.num_resident, c.num_tokens
            s.num_context_evictions, s.num_context_drops = c.num_evictions, c.num_drops
            s.stalled_s = self.stalled_s
            return s.as_dict()

    def _check_params(self, params: SamplingParams) -> None:
        """What only the engine can check: token ids against this model's vocabulary."""
        vocab = self.arch.vocab_size
        for field, ids in (
            ("logit_bias", params.logit_bias),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"{field}: token id {bad} is outside the vocabulary [0, {vocab})", param=field
                )

    def _checked_tokens(self, token_ids: Seq[int], param: str) -> list[int]:
        tokens = list(token_ids)
        bad = next((t for t in tokens if not 0 <= t < self.arch.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary [0, {self.arch.vocab_size})",
                param=param,
            )
        return tokens

    def abort(self, request_id: str) -> bool:
        """Stop a request now: its blocks are freed before this returns."""
        with self._lock:
            seqs = self.requests.pop(request_id, None)
            if seqs is None:
                return False
            for seq in seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.ABORT)
                    self._aborted.append(self._delta(seq, (), None, FinishReason.ABORT))
                    if seq.context is not None:
                        self.contexts.release(seq)
            self._refresh_stats()
            return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._aborted)

    @property
    def stalled_s(self) -> float:
        """How long requests have been waiting with nothing scheduled (0 when not)."""
        since = self._stalled_since
        return 0.0 if since is None else time.monotonic() - since

    # ---- one step -----------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        """One batch forward. A failure that belongs to one request ends that request
        alone with an error delta; a failed forward ends the requests of its batch. Only
        MAX_FAILED_FORWARDS failed forwards in a row raise (the engine is broken)."""
        started = time.perf_counter()
        with self._lock:
            deltas, self._aborted = self._aborted, []
            batch = self.scheduler.schedule()
            self._note_progress(bool(batch.seqs))
        if not batch.seqs:
            return deltas
        prefill_tokens = sum(
            max(0, min(s.num_computed_tokens + n, s.num_prompt_tokens) - s.num_computed_tokens)
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        )
        try:
            logits, sampled = self.runner.run(batch)
            self._failed_forwards = 0
        except Exception as exc:
            self._failed_forwards += 1
            if self._failed_forwards >= MAX_FAILED_FORWARDS:
                raise
            logger.exception("forward failed; ending the %d requests of its batch", len(batch))
            with self._lock:
                for seq in batch.seqs:
                    self._fail(seq.request_id, exc)
                deltas += self._aborted
                self._aborted = []
                self._refresh_stats()
            return deltas
        with self._lock:
            self.scheduler.on_computed(batch)
            rows, seqs = self._expand_forks(sampled)
            if seqs:
                if rows != list(range(len(sampled))):
                    logits = logits[rows]
                for seq, picked in zip(seqs, self._sample(logits, seqs), strict=True):
                    if seq.is_finished:
                        continue  # its request failed earlier in this step
                    try:
                        if isinstance(picked, Exception):
                            raise picked
                        token, lp = picked
                        self.scheduler.append_token(seq, token)
                        if lp is not None:
                            seq.logprobs.append(lp)
                        deltas.append(self._delta(seq, (token,), lp, seq.finish_reason))
                        if seq.is_finished and seq.context is not None:
                            self.contexts.settle(seq)
                    except Exception as exc:
                        self._fail(seq.request_id, exc)
            deltas += self._aborted  # the error deltas of requests that failed here
            self._aborted = []
            for delta in deltas:
                if delta.finish_reason is not None:
                    self._forget_if_done(delta.request_id)
            self._refresh_stats(batch.num_tokens, len(batch.seqs), len(seqs), prefill_tokens)
            self.stats.last_step_time_s = time.perf_counter() - started
        return deltas

    def _note_progress(self, scheduled: bool) -> None:
        self.last_step_scheduled = scheduled
        if scheduled or not self.scheduler.has_work:
            self._stalled_since = None
        elif self._stalled_since is None:
            self._stalled_since = time.monotonic()

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> list[tuple[int, TokenLogprob | None] | Exception]:
        """The batch's tokens; if sampling the batch fails, row by row, so that only the
        requests whose rows fail get the error."""
        try:
            result = self.sampler(logits, seqs)
            return list(zip(result.token_ids, result.logprobs, strict=True))
        except Exception:
            logger.exception("sampling a batch of %d failed; sampling row by row", len(seqs))
        picked: list[tuple[int, TokenLogprob | None] | Exception] = []
        for i, seq in enumerate(seqs):
            try:
                one = self.sampler(logits[i : i + 1], [seq])
                picked.append((one.token_ids[0], one.logprobs[0]))
            except Exception as exc:
                picked.append(exc)
        return picked

    def _fail(self, request_id: str, exc: BaseException) -> None:
        """End one request because of an error of its own: free its blocks, leave its
        context as it was, and queue one delta carrying the error."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return
        if isinstance(exc, ShoalError):
            error = EngineErrorMessage(exc.status_code, exc.error_type, exc.message, exc.param)
        else:
            logger.error("request %s failed: %r", request_id, exc)
            error = EngineErrorMessage(
                500, "engine_error", f"the engine failed on this request: {exc!r}"
            )
        seqs[0].pending_forks = 0
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
                if seq.context is not None:
                    self.contexts.release(seq)
        delta = self._delta(seqs[0], (), None, FinishReason.ABORT)
        self._aborted.append(dataclasses.replace(delta, error=error))

    def _expand_forks(self, sampled: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """Drop sequences aborted during the forward; fork n > 1 requests at their first
        token, each child sampling from its parent's logits row."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        for row, seq in enumerate(sampled):
            if seq.is_finished:
                continue
            try:
                children = []
                while seq.pending_forks:
                    index = seq.params.n - seq.pending_forks
                    seq.pending_forks -= 1
                    child = seq.fork(index)
                    self.block_manager.fork(seq, child)
                    self.scheduler.add_running(child)
                    self.requests[seq.request_id].append(child)
                    children.append(child)
            except Exception as exc:
                self._fail(seq.request_id, exc)
                continue
            for s in (seq, *children):
                rows.append(row)
                seqs.append(s)
        return rows, seqs

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs and all(s.is_finished for s in seqs) and not seqs[0].pending_forks:
            del self.requests[request_id]

    def _delta(self, seq: Sequence, tokens: tuple[int, ...], lp, reason) -> TokenDelta:  # noqa: ANN001
        return TokenDelta(
            request_id=seq.request_id,
            index=seq.index,
            token_ids=tokens,
            logprobs=None if lp is None else (lp,),
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _refresh_stats(
        self, batch_tokens: int = 0, batch_seqs: int = 0, sampled: int = 0, prefill_tokens: int = 0
    ) -> None:
        s, bm = self.stats, self.block_manager.stats()
        if batch_seqs:
            s.num_steps += 1
            s.batch_num_tokens, s.batch_num_seqs = batch_tokens, batch_seqs
            s.max_batch_num_seqs = max(s.max_batch_num_seqs, batch_seqs)
            s.num_generated_tokens += sampled
            s.num_prompt_tokens += prefill_tokens
        s.num_contexts = len(self.contexts)
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_blocks_total, s.kv_blocks_free = bm.total, bm.free
        s.kv_blocks_used, s.kv_blocks_cached = bm.used, bm.cached
        s.num_preemptions = self.scheduler.num_preemptions
        s.prefix_cache_hit_tokens = bm.prefix_hit_tokens
        s.prefix_cache_query_tokens = bm.prefix_query_tokens

    # ---- offline ------------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams],
    ) -> list[RequestOutput]:
        """Run prompts to completion (all at once, continuously batched); results in
        prompt order."""
        params_list = (
            [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        )
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, p in zip(prompts, params_list, strict=True):
            rid = uuid.uuid4().hex
            self.add_request(rid, prompt, p)
            results[rid] = RequestOutput(
                rid, list(prompt), [CompletionOutput(i) for i in range(p.n)]
            )
            order.append(rid)
        while self.has_work:
            for delta in self.step():
                if delta.request_id not in results:
                    continue  # someone else's request on a shared engine
                out = results[delta.request_id].outputs[delta.index]
                out.token_ids.extend(delta.token_ids)
                if delta.logprobs:
                    out.logprobs = (out.logprobs or []) + list(delta.logprobs)
                if delta.finish_reason is not None:
                    out.finish_reason = delta.finish_reason
        return [results[r] for r in order]
