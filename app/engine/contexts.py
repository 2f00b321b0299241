"""Persistent contexts (Parrot's Fill/Generate, llama.cpp's slots): token lists whose KV
blocks stay cached between requests, within limits.

A context holds references on the blocks of its tokens. A primitive on a context runs as
an ordinary request whose sequence starts as a fork of the context: it shares every block
(no recompute) and writes through copy-on-write on the last, partly filled one. When the
primitive finishes, its sequence's blocks become the context's (a Fill keeps its tokens,
a Generate its tokens and the generated ones); when it is aborted, the context stays as
it was (and a context that this primitive created goes away). A new context with a
parent starts as a fork of the parent; each block lives while anyone references it.

Bounded state, so that no client can wedge a replica with contexts it abandons:
- **Eviction.** An idle context is a cache, not a reservation: when running or waiting
  requests need blocks, the least recently used idle contexts give up their KV
  (`evict_kv`). They keep their tokens, and their next primitive recomputes them (blocks
  that were not reused since are found again in the prefix cache, and reused ones in
  the second KV tier where there is one: app/engine/kv_tier.py). So does a busy context
  whose primitive is still waiting (not yet admitted, or preempted): its sequence gives up
  its references too. Else contexts whose primitives all wait could hold every block,
  and nothing could ever run again.
- **Limits.** At most `max_contexts` contexts and `max_tokens` tokens across them. Past
  either, the least recently used idle contexts are dropped; the next call that names a
  dropped one gets a 410 that says so (once: then the id is free again). If every
  context is busy, the call gets a 429.
- A busy context cannot be freed (409): its primitive would hand its blocks to whatever
  context took the id next.
"""

from collections import Counter, OrderedDict
from dataclasses import dataclass

from app.engine.block_manager import BlockManager
from app.engine.sequence import Sequence, SequenceStatus
from app.protocol.errors import (
    CapacityError,
    ConflictError,
    ContextGoneError,
    InvalidRequestError,
    NotFoundError,
)
from app.protocol.messages import ContextAction, ContextOp
from app.protocol.outputs import FinishReason
from app.protocol.sampling import SamplingParams

MAX_TOMBSTONES = 4096  # dropped ids remembered for their 410


@dataclass
class Context:
    context_id: str
    holder: Sequence  # parked, never scheduled: the context's tokens and block references
    primitive: Sequence | None = None  # the primitive in flight
    created_by: str | None = None  # the first primitive, until it succeeds

    @property
    def busy_with(self) -> str | None:
        return None if self.primitive is None else self.primitive.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.holder.token_ids

    @property
    def is_resident(self) -> bool:
        """Whether its KV is in the cache (else the next primitive recomputes it)."""
        return bool(self.holder.block_table)


class ContextStore:
    def __init__(self, block_manager: BlockManager, max_contexts: int, max_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_contexts = max_contexts
        self.max_tokens = max_tokens
        self.contexts: OrderedDict[str, Context] = OrderedDict()  # least recently used first
        self._dropped: OrderedDict[str, str] = OrderedDict()  # id -> why, for its 410
        self.num_evictions = 0  # contexts whose KV was given up (tokens kept)
        self.num_drops = 0  # contexts dropped for the limits

    def __len__(self) -> int:
        return len(self.contexts)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.contexts.values())

    @property
    def num_resident(self) -> int:
        return sum(1 for c in self.contexts.values() if c.is_resident)

    def get(self, context_id: str) -> Context:
        ctx = self.contexts.get(context_id)
        if ctx is None:
            self._raise_if_dropped(context_id)
            raise NotFoundError(f"context {context_id!r} does not exist", param="context_id")
        return ctx

    # ---- a primitive's life ----------------------------------------------------------
    def start(
        self, request_id: str, op: ContextOp, new_token_ids: list[int], params: SamplingParams
    ) -> Sequence:
        """The sequence that runs `op`; creates (or forks) the context when it is new."""
        if params.n != 1:
            raise InvalidRequestError("a context primitive generates one output (n=1)", "n")
        if op.action is ContextAction.FILL and not new_token_ids:
            raise InvalidRequestError("a fill needs at least one token", "token_ids")
        ctx = self.contexts.get(op.context_id)
        held = 0 if ctx is None else len(ctx.token_ids)
        if op.expected_tokens is not None and held != op.expected_tokens:
            raise ContextGoneError(
                f"context {op.context_id!r} holds {held} tokens, not the "
                f"{op.expected_tokens} this call appends to",
                param="context_id",
            )
        if ctx is None:
            ctx = self._create(request_id, op, new_token_ids)
        elif ctx.busy_with is not None:
            raise ConflictError(
                f"context {op.context_id!r} is busy with request {ctx.busy_with!r}",
                param="context_id",
            )
        try:
            tokens = ctx.token_ids + list(new_token_ids)
            if not tokens:
                raise InvalidRequestError(f"context {op.context_id!r} is empty: fill it first")
            growth = len(new_token_ids)
            if op.action is ContextAction.GENERATE:
                growth += params.max_tokens
            self._keep_tokens_within_limit(ctx, growth)
        except BaseException:
            if ctx.created_by == request_id:
                self._remove(ctx)
            raise
        seq = Sequence(request_id, tokens, params)
        self.block_manager.fork(ctx.holder, seq)
        # At least the last token is computed again, so that this primitive has logits.
        seq.num_computed_tokens = min(ctx.holder.num_computed_tokens, len(tokens) - 1)
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.context = op
        ctx.primitive = seq
        self.contexts.move_to_end(op.context_id)
        return seq

    def settle(self, seq: Sequence) -> None:
        """A primitive finished: its blocks (and tokens) become the context's."""
        op: ContextOp = seq.context
        ctx = self.contexts.get(op.context_id)
        if (
            ctx is None
            or ctx.busy_with != seq.request_id  # never another context that took the id
            or seq.finish_reason in (None, FinishReason.ABORT)
        ):
            self.release(seq)
            return
        holder = ctx.holder
        self.block_manager.free(holder)  # the sequence holds its own references on them
        if op.action is ContextAction.FILL:
            holder.token_ids = seq.token_ids[: seq.num_prompt_tokens]  # not the sampled one
        else:
            holder.token_ids = list(seq.token_ids)
        holder.block_table, seq.block_table = seq.block_table, []
        holder.block_hashes, seq.block_hashes = seq.block_hashes, []
        holder.num_computed_tokens = min(seq.num_computed_tokens, len(holder.token_ids))
        ctx.primitive = ctx.created_by = None
        self.contexts.move_to_end(op.context_id)

    def release(self, seq: Sequence) -> None:
        """A primitive ended without result (aborted, failed): the context stays as it
        was, or goes away if this primitive was creating it."""
        self.block_manager.free(seq)
        ctx = self.contexts.get(seq.context.context_id)
        if ctx is None or ctx.busy_with != seq.request_id:
            return
        ctx.primitive = None
        if ctx.created_by == seq.request_id:
            self._remove(ctx)

    # ---- whole contexts --------------------------------------------------------------
    def adopt(self, context_id: str, holder: Sequence) -> None:
        """Make `holder` (tokens and blocks, e.g. restored from a file) a context,
        replacing any idle one of that id."""
        old = self.contexts.get(context_id)
        if old is not None:
            if old.busy_with is not None:
                raise ConflictError(f"context {context_id!r} is busy", param="context_id")
            self._remove(old)
        self._dropped.pop(context_id, None)
        self._make_room_for_one()
        self.contexts[context_id] = Context(context_id, holder)

    def free(self, context_id: str) -> int:
        """Drop a context; returns how many tokens it held (0 for one already dropped)."""
        if context_id not in self.contexts and self._dropped.pop(context_id, None):
            return 0
        ctx = self.get(context_id)
        if ctx.busy_with is not None:
            raise ConflictError(
                f"context {context_id!r} is busy with request {ctx.busy_with!r}; "
                "free it when that request has ended",
                param="context_id",
            )
        held = len(ctx.token_ids)
        self._remove(ctx)
        return held

    # ---- bounded state ---------------------------------------------------------------
    def evict_kv(self, blocks_wanted: int, keep: Sequence | None = None) -> int:
        """Give up the KV of contexts, least recently used first, until `blocks_wanted`
        blocks are free; returns how many blocks it freed. Idle contexts, and busy ones
        whose primitive waits: such a primitive drops its references too (unless it is
        `keep`, the sequence asking for room) and recomputes at admission. Only contexts
        holding blocks that no one else references are worth evicting."""
        bm = self.block_manager
        freed = 0
        for ctx in self.contexts.values():
            if bm.num_free_blocks >= blocks_wanted:
                break
            waiting = ctx.primitive
            if waiting is not None and waiting.status is not SequenceStatus.WAITING:
                continue
            # `keep` keeps its own references, but its context's holder may let go of what
            # only it holds (the partly filled last block): else a context nearly as large
            # as the cache could never grow.
            holders = [ctx.holder] if waiting in (None, keep) else [ctx.holder, waiting]
            refs = Counter(b for h in holders for b in h.block_table)
            if not any(bm.blocks[b].ref_count == n for b, n in refs.items()):
                continue  # every block is shared with someone else: nothing to free
            before = bm.num_free_blocks
            for h in holders:
                bm.free(h)  # tokens stay: the primitive recomputes them when admitted
                h.num_cached_tokens = 0
            freed += bm.num_free_blocks - before
            self.num_evictions += 1
        return freed

    def _create(self, request_id: str, op: ContextOp, new_token_ids: list[int]) -> Context:
        self._raise_if_dropped(op.context_id)
        if op.parent_context_id is not None:
            parent = self.get(op.parent_context_id)
            holder = self._fork(parent.holder, op.context_id)
        elif op.action is ContextAction.FILL or new_token_ids:
            holder = Sequence(f"context:{op.context_id}", [], SamplingParams())
        else:
            raise NotFoundError(f"context {op.context_id!r} does not exist", param="context_id")
        try:
            self._make_room_for_one()
        except BaseException:
            self.block_manager.free(holder)
            raise
        ctx = self.contexts[op.context_id] = Context(op.context_id, holder, created_by=request_id)
        return ctx

    def _make_room_for_one(self) -> None:
        while len(self.contexts) >= self.max_contexts:
            if (
                self._drop_one_idle(f"there were more than max_contexts={self.max_contexts}")
                is None
            ):
                raise CapacityError(
                    f"this replica holds {len(self.contexts)} contexts, its limit, and all "
                    "are busy; free some or retry later",
                    param="context_id",
                )

    def _keep_tokens_within_limit(self, ctx: Context, growth: int) -> None:
        mine = len(ctx.token_ids) + growth
        if mine > self.max_tokens:
            raise InvalidRequestError(
                f"context {ctx.context_id!r} would hold {mine} tokens, more than this "
                f"replica's max_context_tokens={self.max_tokens}",
                param="context_id",
            )
        reason = f"contexts held more than max_context_tokens={self.max_tokens} tokens"
        held = self.num_tokens
        while held + growth > self.max_tokens:
            victim = self._drop_one_idle(reason, keep=ctx)
            if victim is None:
                raise CapacityError(
                    f"contexts on this replica hold {held} tokens and are busy; "
                    f"{growth} more would pass max_context_tokens={self.max_tokens}; "
                    "retry later",
                    param="context_id",
                )
            held -= len(victim.token_ids)

    def _drop_one_idle(self, reason: str, keep: Context | None = None) -> Context | None:
        victim = next(
            (c for c in self.contexts.values() if c.busy_with is None and c is not keep), None
        )
        if victim is None:
            return None
        self._remove(victim)
        self._dropped[victim.context_id] = reason
        while len(self._dropped) > MAX_TOMBSTONES:
            self._dropped.popitem(last=False)
        self.num_drops += 1
        return victim

    def _raise_if_dropped(self, context_id: str) -> None:
        reason = self._dropped.pop(context_id, None)
        if reason is not None:
            raise ContextGoneError(
                f"context {context_id!r} was dropped because {reason} (least recently used "
                "first); fill it again to use this id",
                param="context_id",
            )

    def _remove(self, ctx: Context) -> None:
        self.block_manager.free(ctx.holder)
        del self.contexts[ctx.context_id]

    def _fork(self, parent: Sequence, context_id: str) -> Sequence:
        holder = Sequence(f"context:{context_id}", list(parent.token_ids), SamplingParams())
        self.block_manager.fork(parent, holder)
        holder.num_computed_tokens = parent.num_computed_tokens
        return holder
