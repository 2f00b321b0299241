"""RequestTable: the engine's live requests, and the deltas of those that ended between
steps or outside a step's normal flow (aborted, failed).

A request is a family of sequences: the one it was added with, then the n - 1 outputs
forked from it at its first token.

Invariants:
- a request id is in the table from its admission until every output has finished, or
  until it is aborted or fails, and never twice at once;
- a request that is aborted or fails leaves the table at once, with its unfinished
  sequences finished (blocks freed, a context left as it was), and queues its last
  deltas here: one per unfinished output when aborted, one carrying the error when it
  failed. The engine hands them out with the next step's deltas.
"""

import dataclasses
import logging

from app.engine.contexts import ContextStore
from app.engine.scheduler import Scheduler
from app.engine.sequence import Sequence
from app.protocol.errors import ConflictError, ShoalError
from app.protocol.outputs import EngineErrorMessage, FinishReason, TokenDelta, TokenLogprob

logger = logging.getLogger(__name__)


class RequestTable:
    def __init__(self, scheduler: Scheduler, contexts: ContextStore) -> None:
        self.scheduler = scheduler
        self.contexts = contexts
        self._families: dict[str, list[Sequence]] = {}
        self._ended: list[TokenDelta] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._families

    def __len__(self) -> int:
        return len(self._families)

    def check_unused(self, request_id: str) -> None:
        if request_id in self._families:
            raise ConflictError(f"request id {request_id!r} is already in use")

    def add(self, seq: Sequence) -> None:
        self.check_unused(seq.request_id)
        self._families[seq.request_id] = [seq]

    def family(self, request_id: str) -> list[Sequence]:
        """A live request's sequences; a fork appends its children here."""
        return self._families[request_id]

    def expand_forks(self, sampled: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """Drop sequences aborted during the forward; fork n > 1 requests at their first
        token, each child sampling from its parent's logits row."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        for row, seq in enumerate(sampled):
            if seq.is_finished:
                continue
            family = self.family(seq.request_id)
            num_before = len(family)
            try:
                self.scheduler.fork_pending(seq, into=family)
            except Exception as exc:
                self.fail(seq.request_id, exc)
                continue
            for s in (seq, *family[num_before:]):
                rows.append(row)
                seqs.append(s)
        return rows, seqs

    @property
    def has_ended(self) -> bool:
        return bool(self._ended)

    def take_ended(self) -> list[TokenDelta]:
        ended, self._ended = self._ended, []
        return ended

    def abort(self, request_id: str) -> bool:
        """End a request now; False when it is not live (never added, or finished)."""
        seqs = self._families.pop(request_id, None)
        if seqs is None:
            return False
        self._ended += [delta(seq) for seq in self._end(seqs)]
        return True

    def fail(self, request_id: str, exc: BaseException) -> None:
        """End a request because of an error of its own, with one delta carrying it."""
        seqs = self._families.pop(request_id, None)
        if seqs is None:
            return
        if not isinstance(exc, ShoalError):
            logger.error("request %s failed: %r", request_id, exc)
        seqs[0].pending_forks = 0
        self._end(seqs)
        reason, error = FinishReason.ABORT, _error_message(exc)
        self._ended.append(dataclasses.replace(delta(seqs[0]), finish_reason=reason, error=error))

    def forget_finished(self, deltas: list[TokenDelta]) -> None:
        """Drop the requests whose last output finished in `deltas`."""
        for d in deltas:
            if d.finish_reason is None:
                continue
            seqs = self._families.get(d.request_id)
            if seqs and all(s.is_finished for s in seqs) and not seqs[0].pending_forks:
                del self._families[d.request_id]

    def _end(self, seqs: list[Sequence]) -> list[Sequence]:
        ended = [s for s in seqs if not s.is_finished]
        for seq in ended:
            self.scheduler.finish(seq, FinishReason.ABORT)
            if seq.context is not None:
                self.contexts.release(seq)
        return ended


def delta(
    seq: Sequence, tokens: tuple[int, ...] = (), lp: TokenLogprob | None = None
) -> TokenDelta:
    """`seq`'s new tokens since its last delta, with its finish reason (None while it runs)."""
    return TokenDelta(
        request_id=seq.request_id,
        index=seq.index,
        token_ids=tokens,
        logprobs=None if lp is None else (lp,),
        finish_reason=seq.finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_tokens,
    )


def _error_message(exc: BaseException) -> EngineErrorMessage:
    if isinstance(exc, ShoalError):
        return EngineErrorMessage(exc.status_code, exc.error_type, exc.message, exc.param)
    return EngineErrorMessage(500, "engine_error", f"the engine failed on this request: {exc!r}")
