"""Scheduler: iteration-level continuous batching with chunked prefill and preemption.

Each step spends a token budget (`max_num_batched_tokens`): running sequences first,
in arrival order (one token each when decoding, a chunk of the prompt otherwise), then
waiting ones. When the KV cache runs out, the newest running sequence is preempted:
its blocks are freed (full ones stay in the prefix cache) and it goes back to the head
of the queue, to be recomputed later with the same tokens and so the same output.
Before anything running is preempted, or a waiting request is left waiting, idle
persistent contexts give up their KV (`reclaim`): they are a cache, not a reservation.

A request with `n` outputs is admitted only when all of them fit under `max_num_seqs`
(its outputs fork from it at its first token and join the batch at once).

`running` is an insertion-ordered dict used as an ordered set (admission order, O(1)
removal): sequences finish and are preempted from anywhere in it on every step.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from app.engine.block_manager import BlockManager, CopyOnWrite
from app.engine.images import chunk_end
from app.engine.sequence import Sequence, SequenceStatus
from app.engine.speculation import PromptLookup, accepted_prefix
from app.protocol.errors import ContextLengthExceededError, InvalidRequestError
from app.protocol.outputs import FinishReason, SlotInfo


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copies: list[CopyOnWrite] = field(default_factory=list)
    scheduled: set[int] = field(default_factory=set)  # seq_ids of `seqs`
    # For the runner's persistent rows (app.engine.input_batch): sequences whose block
    # table changed other than by appending (copy-on-write), and those that left the
    # running set (finished, aborted, preempted) since the last batch.
    tables_changed: set[int] = field(default_factory=set)
    left: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        reclaim: Callable[[int, Sequence], int] = lambda blocks_wanted, seq: 0,
        speculation: PromptLookup | None = None,
    ) -> None:
        """`reclaim(n, seq)` frees KV held by persistent contexts (never `seq`'s, which
        asks for the room) until `n` blocks are free, and returns how many it freed.
        `speculation`: proposals for plain decodes (app.engine.speculation)."""
        self.block_manager = block_manager
        self.speculation = speculation
        self.reclaim = reclaim
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[Sequence, None] = {}  # ordered set, oldest first
        self.num_preemptions = 0
        self._left: list[int] = []  # seq_ids that left `running` since the last batch

    # ---- admission ----------------------------------------------------------------
    def check_admissible(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ContextLengthExceededError(num_prompt_tokens, max_tokens, self.max_model_len)
        bm = self.block_manager
        if bm.blocks_needed(num_prompt_tokens + max_tokens) > bm.num_blocks:
            raise InvalidRequestError(
                f"{num_prompt_tokens + max_tokens} tokens need more KV cache blocks than the "
                f"{bm.num_blocks} blocks of {bm.block_size} tokens this server has",
                param="max_tokens",
            )

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq.num_prompt_tokens, seq.params.max_tokens)
        if seq.params.n > self.max_num_seqs:
            raise InvalidRequestError(
                f"n={seq.params.n} outputs are more than the {self.max_num_seqs} sequences "
                "this server batches (max_num_seqs)",
                param="n",
            )
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A fork joins the batch directly: its KV is already there."""
        seq.status = SequenceStatus.RUNNING
        self.running[seq] = None

    def fork_pending(self, seq: Sequence, into: list[Sequence]) -> None:
        """At its first token, a request of n > 1 outputs forks the n - 1 others: each
        shares its blocks and joins the batch at once. Each child is appended to `into`
        as soon as it runs, so a failure midway leaves none unaccounted for."""
        while seq.pending_forks:
            index = seq.params.n - seq.pending_forks
            seq.pending_forks -= 1
            child = seq.fork(index)
            self.block_manager.fork(seq, child)
            self.add_running(child)
            into.append(child)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def slots(self) -> list[SlotInfo]:
        """`max_num_seqs` seats (more while more are busy): each running, then waiting,
        sequence holds one, in admission order; the rest are idle."""
        busy = [(s, "running") for s in self.running] + [(s, "waiting") for s in self.waiting]
        slots = [
            SlotInfo(
                index=i,
                state=state,
                max_model_len=self.max_model_len,
                request_id=seq.request_id,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_cached_tokens=seq.num_cached_tokens,
                num_output_tokens=seq.num_output_tokens,
                params=seq.params,
            )
            for i, (seq, state) in enumerate(busy)
        ]
        idle = range(len(busy), self.max_num_seqs)
        return slots + [SlotInfo(i, "idle", self.max_model_len) for i in idle]

    # ---- one step -----------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            n = self._chunk(seq, budget) + self._propose(seq, budget)
            if not self._make_room(seq, n, batch):
                preempted = True
                continue
            self._add_to_batch(batch, seq, n)
            budget -= n
        if not preempted:
            self._admit_waiting(batch, budget)
        if batch.seqs:  # an empty batch reaches no runner: departures wait for one
            batch.left, self._left = self._left, []
        return batch

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The tokens `seq` computes in this step: the rest of its prompt, or a chunk of
        it that does not cut an image's span (app.engine.images.chunk_end)."""
        start = seq.num_computed_tokens
        end = start + min(seq.num_tokens - start, budget)
        return chunk_end(seq.images, start, end) - start if seq.images else end - start

    def _propose(self, seq: Sequence, budget: int) -> int:
        """Set `seq.draft` (a proposal to verify after its last token, when it decodes and
        may speculate, and the cache keeps a block for every running sequence besides:
        a proposal never preempts one, nor takes a context's KV); its length."""
        seq.draft = []
        if self.speculation is None or seq.num_computed_tokens != seq.num_tokens - 1:
            return 0
        draft = self.speculation.propose(seq, budget - 1, len(self.running), self.max_model_len)
        bm = self.block_manager
        spare = bm.num_free_blocks - len(self.running)  # a block each for the others' steps
        if draft and bm.blocks_to_append(seq, 1 + len(draft)) <= spare:
            seq.draft = draft
        return len(seq.draft)

    def _make_room(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Preempt the newest unscheduled running sequences until `seq` fits; False if
        `seq` itself had to go."""
        bm = self.block_manager
        while not bm.can_append(seq, n):
            if self.reclaim(bm.blocks_to_append(seq, n), seq):
                continue
            victim = next(
                (s for s in reversed(self.running) if s.seq_id not in batch.scheduled), None
            )
            if victim is None or victim is seq:
                self._preempt(seq)
                return False
            self._preempt(victim)
        return True

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        """Admit waiting requests in order while seats, blocks and budget last. A request
        whose outputs need more seats than are free lets narrower ones behind it pass,
        until `max_num_seqs` of them have: then the queue waits for seats to drain to it
        (else a stream of small requests could keep a wide one out for ever)."""
        bm = self.block_manager
        # Outputs not yet forked take their seats from admission on.
        seats = len(self.running) + sum(s.pending_forks for s in self.running)
        too_wide: list[Sequence] = []
        # Admitted sequences leave the queue as they go and passed-over ones stay at its
        # head, so the next candidate is always at index len(too_wide): no copy, no scan.
        while budget > 0 and len(self.waiting) > len(too_wide):
            seq = self.waiting[len(too_wide)]
            if seats + 1 + seq.pending_forks > self.max_num_seqs:
                if seq.passed_over >= self.max_num_seqs:
                    break
                too_wide.append(seq)
                continue
            if not seq.block_table:
                if bm.tier is not None:  # room first, for what the tier can give back
                    short = bm.blocks_needed(seq.num_tokens) - bm.num_free_blocks
                    if short > 0:
                        self.reclaim(short, seq)
                bm.allocate_cached_prefix(seq)
            n = self._chunk(seq, budget)
            if not bm.can_append(seq, n):
                self.reclaim(bm.blocks_to_append(seq, n), seq)
            if not bm.can_append(seq, n):
                bm.free(seq)  # give back the prefix hits; try again next step
                break
            del self.waiting[len(too_wide)]
            seq.status = SequenceStatus.RUNNING
            self.running[seq] = None
            seats += 1 + seq.pending_forks
            for wide in too_wide:
                wide.passed_over += 1
            self._add_to_batch(batch, seq, n)
            budget -= n

    def _add_to_batch(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        cow = self.block_manager.append_slots(seq, n)
        if cow is not None:
            batch.copies.append(cow)
            batch.tables_changed.add(seq.seq_id)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        batch.scheduled.add(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        seq.draft = []
        del self.running[seq]
        self._left.append(seq.seq_id)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- after the forward pass ---------------------------------------------------
    def on_computed(self, batch: ScheduledBatch) -> None:
        """A step's tokens are computed: a proposal's count once accepted (accept_draft)."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.status is SequenceStatus.RUNNING:  # not aborted meanwhile
                seq.num_computed_tokens += n - len(seq.draft)
                self.block_manager.register_computed(seq)

    def accept_draft(self, seq: Sequence, picks: list[int]) -> tuple[int, ...]:
        """Append the tokens the sampler's `picks` (one per position of the last token
        and `seq.draft`) give: the draft up to its first miss, then the pick
        there, stopping where the sequence finishes. The accepted draft tokens' KV was
        computed in the step. Returns the tokens appended."""
        draft, seq.draft = seq.draft, []
        accepted = accepted_prefix(draft, picks)
        tokens = (*draft[:accepted], picks[accepted])
        for i, token in enumerate(tokens):
            self.append_token(seq, token)
            if seq.is_finished:
                tokens = tokens[: i + 1]
                break
            if i < accepted:
                seq.num_computed_tokens += 1
        else:
            self.block_manager.register_computed(seq)
        if self.speculation is not None:  # the proposed tokens that came out
            self.speculation.record(len(draft), min(accepted, len(tokens)))
        return tokens

    def append_token(self, seq: Sequence, token_id: int) -> None:
        """Append a sampled token; finish the sequence if it should stop."""
        seq.token_ids.append(token_id)
        params = seq.params
        n_out = seq.num_output_tokens
        reason = None
        if n_out >= params.min_tokens and (
            (not params.ignore_eos and token_id in self.eos_token_ids)
            or token_id in params.stop_token_ids
        ):
            reason = FinishReason.STOP
        elif n_out >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.finish(seq, reason)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            del self.running[seq]
            self._left.append(seq.seq_id)
        elif seq in self.waiting:  # an abort before admission: rare enough for a scan
            self.waiting.remove(seq)
        if seq.context is None or reason is FinishReason.ABORT:
            self.block_manager.free(seq)
        # else: the engine hands the blocks to the context (ContextStore.settle)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.matcher = None
