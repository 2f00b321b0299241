"""Persistent contexts (Parrot's Fill/Generate): token lists whose KV blocks stay cached.

A context holds references on the blocks of its tokens, so they are never evicted while
it lives. A primitive on a context runs as an ordinary request whose sequence starts as a
fork of the context: it shares every block (no recompute) and writes through copy-on-write
on the last, partly filled one. When the primitive finishes, its sequence's blocks
become the context's (a Fill keeps its tokens, a Generate its tokens and the generated
ones); when it is aborted, the context stays as it was. A new context with a parent
starts as a fork of the parent, and freeing a parent leaves its children's shared blocks
alone: each block lives while anyone references it.
"""

from dataclasses import dataclass

from app.engine.block_manager import BlockManager
from app.engine.sequence import Sequence
from app.protocol.errors import ConflictError, InvalidRequestError, NotFoundError
from app.protocol.messages import ContextOp, Primitive
from app.protocol.sampling import SamplingParams


@dataclass
class Context:
    context_id: str
    holder: Sequence  # parked, never scheduled: the context's tokens and block references
    busy_with: str | None = None  # the request id of the primitive in flight

    @property
    def token_ids(self) -> list[int]:
        return self.holder.token_ids


class ContextStore:
    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.contexts: dict[str, Context] = {}

    def __len__(self) -> int:
        return len(self.contexts)

    def get(self, context_id: str) -> Context:
        ctx = self.contexts.get(context_id)
        if ctx is None:
            raise NotFoundError(f"context {context_id!r} does not exist", param="context_id")
        return ctx

    def start(
        self, request_id: str, op: ContextOp, new_token_ids: list[int], params: SamplingParams
    ) -> Sequence:
        """The sequence that runs `op`; creates (or forks) the context when it is new."""
        if params.n != 1:
            raise InvalidRequestError("a context primitive generates one output (n=1)", "n")
        if op.primitive is Primitive.FILL and not new_token_ids:
            raise InvalidRequestError("a fill needs at least one token", "token_ids")
        ctx = self.contexts.get(op.context_id)
        if ctx is None:
            if op.parent_context_id is not None:
                parent = self.get(op.parent_context_id)
                holder = self._fork(parent.holder, op.context_id)
            elif op.primitive is Primitive.FILL or new_token_ids:
                holder = Sequence(f"context:{op.context_id}", [], SamplingParams())
            else:
                raise NotFoundError(f"context {op.context_id!r} does not exist", param="context_id")
            ctx = self.contexts[op.context_id] = Context(op.context_id, holder)
        if ctx.busy_with is not None:
            raise ConflictError(
                f"context {op.context_id!r} is busy with request {ctx.busy_with!r}",
                param="context_id",
            )
        tokens = ctx.token_ids + list(new_token_ids)
        if not tokens:
            raise InvalidRequestError(f"context {op.context_id!r} is empty: fill it first")
        seq = Sequence(request_id, tokens, params)
        self.block_manager.fork(ctx.holder, seq)
        # At least the last token is computed again, so that this primitive has logits.
        seq.num_computed_tokens = min(ctx.holder.num_computed_tokens, len(tokens) - 1)
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.context = op
        ctx.busy_with = request_id
        return seq

    def settle(self, seq: Sequence) -> None:
        """A primitive finished: its blocks (and tokens) become the context's."""
        op: ContextOp = seq.context
        ctx = self.contexts.get(op.context_id)
        if ctx is None or seq.finish_reason is None or seq.finish_reason.value == "abort":
            self.release(seq)
            return
        holder = ctx.holder
        self.block_manager.free(holder)  # the sequence holds its own references on them
        if op.primitive is Primitive.FILL:
            holder.token_ids = seq.token_ids[: seq.num_prompt_tokens]  # not the sampled one
        else:
            holder.token_ids = list(seq.token_ids)
        holder.block_table, seq.block_table = seq.block_table, []
        holder.block_hashes, seq.block_hashes = seq.block_hashes, []
        holder.num_computed_tokens = min(seq.num_computed_tokens, len(holder.token_ids))
        ctx.busy_with = None

    def release(self, seq: Sequence) -> None:
        """A primitive ended without result (aborted): the context stays as it was."""
        self.block_manager.free(seq)
        ctx = self.contexts.get(seq.context.context_id)
        if ctx is not None and ctx.busy_with == seq.request_id:
            ctx.busy_with = None

    def adopt(self, context_id: str, holder: Sequence) -> None:
        """Make `holder` (tokens and blocks, e.g. restored from a file) a context,
        replacing any idle one of that id."""
        old = self.contexts.get(context_id)
        if old is not None:
            if old.busy_with is not None:
                raise ConflictError(f"context {context_id!r} is busy", param="context_id")
            self.block_manager.free(old.holder)
        self.contexts[context_id] = Context(context_id, holder)

    def free(self, context_id: str) -> None:
        ctx = self.get(context_id)
        self.block_manager.free(ctx.holder)
        del self.contexts[context_id]

    def _fork(self, parent: Sequence, context_id: str) -> Sequence:
        holder = Sequence(f"context:{context_id}", list(parent.token_ids), SamplingParams())
        self.block_manager.fork(parent, holder)
        holder.num_computed_tokens = parent.num_computed_tokens
        return holder
