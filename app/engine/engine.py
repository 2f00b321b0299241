"""LLMEngine: add_request / step / abort over the scheduler, model runner and sampler.

One step reads like the design: schedule -> run the model -> sample -> append tokens.
The engine is single-stepped by one thread; every other method may be called from
others: they take `lock`, which a step releases while the model runs. Everything it
hands out is neutral (TokenDelta, SlotInfo, dicts of stats): front-ends and dialects
shape their own views.
"""

import logging
import threading
import time
from collections.abc import Sequence as Seq

import torch

from app.engine import offline
from app.engine.adapters import AdapterTable
from app.engine.block_manager import BlockManager
from app.engine.config import EngineConfig
from app.engine.contexts import ContextStore
from app.engine.grammar import GrammarBackend, StepMasks, request_matcher
from app.engine.images import attach as attach_images
from app.engine.images import encode_due, release_computed
from app.engine.kv_tier import open_tier
from app.engine.model_runner import load_runner
from app.engine.mrope import rope_positions
from app.engine.requests import RequestTable, delta
from app.engine.sampler import Sampler
from app.engine.scheduler import ScheduledBatch, Scheduler
from app.engine.sequence import Sequence
from app.engine.speculation import PromptLookup, split_verified
from app.engine.stats import EngineStats, num_prefill_tokens
from app.engine.validation import check_params, checked_token_ids
from app.models.loader import LoadedModel
from app.models.parallel import TPGroup
from app.protocol.errors import InvalidRequestError
from app.protocol.images import ImageInput
from app.protocol.messages import ContextAction, ContextOp
from app.protocol.outputs import FinishReason, RequestOutput, SlotInfo, TokenDelta
from app.protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)

MAX_FAILED_FORWARDS = 3  # in a row: past this a forward failure is the engine's, not a batch's
FILL_PARAMS = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)  # its sample is dropped


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
        self.loaded, self.runner = load_runner(config, tp, loaded)
        self.source = self.loaded.source
        self.arch = self.loaded.arch
        self.max_model_len = self.loaded.max_model_len
        bm = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        bm.tier = self.tier = open_tier(config, self.runner, tp)
        self.block_manager = bm
        self.contexts = ContextStore(bm, config.max_contexts, config.max_context_tokens)
        self.scheduler = Scheduler(
            bm,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            self.arch.eos_token_ids,
            reclaim=self.contexts.evict_kv,
            speculation=PromptLookup.of(config.speculative, self.arch.vocab_size),
        )
        self.sampler = Sampler(self.arch.vocab_size, self.arch.eos_token_ids, config.seed)
        self.requests = RequestTable(self.scheduler, self.contexts)
        self.grammar: GrammarBackend | None = None
        if config.structured_outputs:
            eos = self.arch.eos_token_ids
            self.grammar = GrammarBackend(self.source, self.arch.vocab_size, eos)
        self.adapters = AdapterTable(self.loaded, config.max_loras, config.loras)
        self._failed_forwards = 0  # in a row; past MAX_FAILED_FORWARDS the engine is broken
        self._stalled_since: float | None = None  # work waiting, nothing scheduled
        self.last_step_scheduled = False
        self.lock = threading.RLock()
        self.stats = EngineStats()
        self._record_state()

    # ---- requests -----------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        context: ContextOp | None = None,
        images: Seq[ImageInput] = (),
    ) -> None:
        """Queue a request; raises InvalidRequestError (or ContextLengthExceededError)
        when it can never be served. With `context`, a Fill or Generate on that
        persistent context (see app.engine.contexts): `prompt_token_ids` are the tokens
        it adds, and a Fill computes their KV and samples nothing the client keeps.
        `images` stand in spans of the prompt (app.engine.images)."""
        vocab = self.arch.vocab_size
        param = "prompt" if context is None else "token_ids"
        tokens = checked_token_ids(prompt_token_ids, vocab, param)
        if images and context is not None:
            raise InvalidRequestError("images cannot be added to a context", "messages")
        seq_images = attach_images(tokens, images, self.loaded.vision, vocab)
        if context is not None and not context.action.generates:
            raise InvalidRequestError(f"a request cannot {context.action} a context")
        if params.lora is not None and context is not None:
            raise InvalidRequestError("a context runs on the base model, not an adapter", "model")
        if context is not None and context.action is ContextAction.FILL:
            params = FILL_PARAMS
        check_params(params, vocab)
        matcher = request_matcher(self.grammar, params)
        with self.lock:
            self.requests.check_unused(request_id)
            if context is None:
                seq = Sequence(request_id, tokens, params, 0, time.monotonic())
                seq.lora = None if params.lora is None else self.adapters.take(params.lora)
                seq.matcher = matcher
                seq.images = seq_images
                seq.rope = rope_positions(len(tokens), seq_images, self.loaded.vision)
                self.scheduler.add(seq)
            else:
                seq = self.contexts.start(request_id, context, tokens, params)
                seq.arrival = time.monotonic()
                seq.matcher = matcher
                try:
                    self.scheduler.add(seq)
                except BaseException:
                    self.contexts.release(seq)
                    raise
            self.requests.add(seq)

    def set_lora(self, name: str, path: str | None) -> None:
        """Run the PEFT adapter at `path` as `name` (InvalidRequestError if it does not
        fit), or no more (None); a request under way keeps the adapter it started with.
        The files are read outside the lock: steps go on meanwhile."""
        with self.lock:
            if path is None:
                self.adapters.forget(name)
                return
            if self.adapters.holds(name, path):
                self.adapters.take(name)  # now the most recently used
                return
        adapter = self.adapters.read(name, path)
        with self.lock:
            self.adapters.hold(name, path, adapter)

    def abort(self, request_id: str) -> bool:
        """Stop a request now: its blocks are freed before this returns. False when the
        engine does not know it (never added, or already finished)."""
        with self.lock:
            known = self.requests.abort(request_id)
            self._record_state()
            return known

    def generate(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion (all at once, continuously batched); results in
        prompt order. Offline use only: it steps this engine itself."""
        return offline.generate(self, prompts, params)

    # ---- contexts -----------------------------------------------------------------
    def free_context(self, context_id: str) -> int:
        """Drop a context; returns how many tokens it held. A busy one is a ConflictError."""
        with self.lock:
            held = self.contexts.free(context_id)
            self._record_state()
            return held

    def context_tokens(self, context_id: str) -> list[int]:
        with self.lock:
            return list(self.contexts.get(context_id).token_ids)

    # ---- views --------------------------------------------------------------------
    def slots(self) -> list[SlotInfo]:
        """See Scheduler.slots: running, then waiting, requests, then idle seats."""
        with self.lock:
            return self.scheduler.slots()

    def stats_snapshot(self) -> dict:
        """The stats, current as of this call, with the figures that cost a pass over the
        contexts (taken here, when asked, not after every step)."""
        with self.lock:
            self._record_state()
            s, c = self.stats, self.contexts
            s.num_contexts_resident, s.num_context_tokens = c.num_resident, c.num_tokens
            s.num_context_evictions, s.num_context_drops = c.num_evictions, c.num_drops
            s.stalled_s = self.stalled_s
            if (speculation := self.scheduler.speculation) is not None:
                s.record_speculation(speculation.counts)
            if self.grammar is not None:
                s.grammar_mask_steps = self.grammar.mask_steps
                s.grammar_mask_s = self.grammar.mask_seconds
            return s.as_dict()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.requests.has_ended

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
        with self.lock:
            deltas = self.requests.take_ended()
            batch = self.scheduler.schedule()
            self._note_progress(bool(batch.seqs))
            if not batch.seqs:
                return deltas
            prefill_tokens = num_prefill_tokens(batch)  # before the forward moves them on
            # The inputs are read from the sequences in the same hold of the lock: an abort
            # in between would free a sequence's blocks while its cache slots are computed.
            try:
                if self.loaded.vision is not None:
                    encode_due(self.loaded.vision, batch.seqs, batch.num_new_tokens)
                step, sampled = self.runner.prepare(batch)
            except Exception as exc:
                return deltas + self._fail_batch(batch, exc)
        masking = self._start_masks(batch)  # on the grammar's thread, while the model runs
        try:
            logits = self.runner.run(step)
            masks = None if masking is None else masking.result()
            self._failed_forwards = 0
        except Exception as exc:
            self._failed_forwards += 1
            if self._failed_forwards >= MAX_FAILED_FORWARDS:
                raise
            return deltas + self._fail_batch(batch, exc)
        with self.lock:
            self.scheduler.on_computed(batch)
            release_computed(batch.seqs)
            num_sampled = self._postprocess(logits, sampled, deltas, masks)
            deltas += self.requests.take_ended()  # those of requests that failed here
            self.requests.forget_finished(deltas)
            self.stats.record_step(batch.num_tokens, len(batch), num_sampled, prefill_tokens)
            self.stats.last_step_time_s = time.perf_counter() - started
            self._record_state()
        return deltas

    def _start_masks(self, batch: ScheduledBatch):  # noqa: ANN202 (a Future or None)
        if self.grammar is None:
            return None
        due = [
            seq
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if seq.num_computed_tokens + n == seq.num_tokens  # sampled in this step
        ]
        return self.grammar.start_masks(due)

    def _postprocess(
        self,
        logits: torch.Tensor,
        sampled: list[Sequence],
        deltas: list[TokenDelta],
        masks: StepMasks | None = None,
    ) -> int:
        """Sample each due sequence's next token (or accept a proposal's: speculation.py),
        append it, and add its delta to `deltas`; returns how many tokens came out."""
        verified: list[tuple[Sequence, list[int] | Exception]] = []
        if any(seq.draft for seq in sampled):
            logits, sampled, verified = split_verified(logits, sampled, self.sampler.sample_each)
        extra = 0
        for seq, picks in verified:
            if isinstance(picks, Exception):
                self.requests.fail(seq.request_id, picks)
            elif not seq.is_finished:  # else its request failed or was aborted meanwhile
                tokens = self.scheduler.accept_draft(seq, picks)
                deltas.append(delta(seq, tokens))
                extra += len(tokens)
        rows, seqs = self.requests.expand_forks(sampled)
        if not seqs:
            return extra
        if rows != list(range(len(sampled))):
            logits = logits[rows]  # (S', vocab): a fork samples from its parent's row
        forbidden = None
        if masks is not None:
            for seq in seqs:
                if seq.seq_id in masks.errors:
                    message = f"the output's grammar failed: {masks.errors[seq.seq_id]}"
                    self.requests.fail(seq.request_id, InvalidRequestError(message))
            # A fork's first token follows its parent's mask (the same matcher state).
            due = [
                sampled[r].seq_id if s.matcher is not None else None
                for r, s in zip(rows, seqs, strict=True)
            ]
            forbidden = masks.forbidden(due)
        picks = self.sampler.sample_each(logits, seqs, forbidden)
        for seq, picked in zip(seqs, picks, strict=True):
            if seq.is_finished:
                continue  # its request failed earlier in this step
            try:
                if isinstance(picked, Exception):
                    raise picked
                token, lp = picked
                self.scheduler.append_token(seq, token)
                if seq.matcher is not None:
                    self._advance_matcher(seq, token)
                if lp is not None:
                    seq.logprobs.append(lp)
                deltas.append(delta(seq, (token,), lp))
                if seq.is_finished and seq.context is not None:
                    self.contexts.settle(seq)
            except Exception as exc:
                self.requests.fail(seq.request_id, exc)
        return len(seqs) + extra

    def _advance_matcher(self, seq: Sequence, token: int) -> None:
        """Feed the sampled token to the sequence's grammar; end the output once the
        grammar allows nothing more (no EOS step needed)."""
        if not seq.matcher.consume_token(token):
            error = seq.matcher.get_error() or f"token {token} is not allowed"
            raise InvalidRequestError(f"the output's grammar failed: {error.splitlines()[0]}")
        if seq.matcher.is_stopped():
            self.scheduler.finish(seq, FinishReason.STOP)

    def _note_progress(self, scheduled: bool) -> None:
        self.last_step_scheduled = scheduled
        if scheduled or not self.scheduler.has_work:
            self._stalled_since = None
        elif self._stalled_since is None:
            self._stalled_since = time.monotonic()

    def _fail_batch(self, batch: ScheduledBatch, exc: Exception) -> list[TokenDelta]:
        """A forward failed: end the requests of its batch, each with an error delta."""
        logger.exception("forward failed; ending the %d requests of its batch", len(batch))
        with self.lock:
            for seq in batch.seqs:
                self.requests.fail(seq.request_id, exc)
            self._record_state()
            return self.requests.take_ended()

    def _record_state(self) -> None:
        self.stats.record_state(self.scheduler, self.block_manager, len(self.contexts))
