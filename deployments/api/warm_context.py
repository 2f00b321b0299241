"""A conversation kept warm: an Assistants thread, or a chain of Responses, is a
persistent context on a model replica (app/engine/contexts.py), which the affinity
router keeps on the replica that holds it.

A turn renders the whole conversation with the model's chat template and compares it
with the tokens the context holds (the last turn's prompt and its reply). When they are
a prefix, the turn appends only the new tokens (the new messages and the generation
prompt) and generates: no re-prefill of the history. Otherwise the context is rebuilt
from the stored conversation, and the log says why: the replica restarted or was scaled
down, the context was dropped for the replica's limits, or the prompt changed (other
instructions, another model, an edited or deleted message, a branch from an earlier
turn). The append names the length it appends to (`ContextOp.expected_tokens`), so a
context lost between the read and the append is never extended from the middle: that
append fails, and the turn rebuilds.
"""

import asyncio
import logging

from app.protocol.errors import ContextLengthExceededError, ShoalError
from app.protocol.messages import ContextAction, ContextOp
from app.protocol.sampling import SamplingParams
from app.text.reasoning import ReasoningFormat
from deployments.http.generation import Generation
from deployments.ingress import Ingress

logger = logging.getLogger("ray.serve")
BUSY_PAUSES_S = (0.05, 0.1, 0.2, 0.4, 0.8, None)  # a busy (409) context: waits, then give up


async def generate_in_context(
    ingress: Ingress,
    model: str,
    cid: str,
    prompt_ids: list[int],
    params: SamplingParams,
    tag: str,
    busy_pauses: tuple[float | None, ...] = BUSY_PAUSES_S,
    reasoning: ReasoningFormat | None = None,
) -> tuple[Generation, int]:
    """Start the turn's generation in context `cid`; also returns how many of the
    prompt's tokens the context already held (0: rebuilt). A context still busy after
    `busy_pauses` is a 409. `reasoning`: as for Ingress.generate."""
    held = await held_tokens(ingress, model, cid)
    stale = held is not None  # a copy that the rebuild must drop first
    if held is not None and _extends(prompt_ids, held):
        op = ContextOp(cid, ContextAction.GENERATE, expected_tokens=len(held))
        try:
            new = prompt_ids[len(held) :]
            gen = await _generate(
                ingress, model, new, params, tag, op, prompt_ids, busy_pauses, reasoning
            )
            return gen, len(held)
        except ShoalError as exc:  # lost or changed since the read (410): rebuild
            if not _gone(exc):
                raise
            why = exc.message  # the refused append may have left a dropped one's mark
    else:
        why = _why_rebuilt(held)
    # A rebuild drops the old copy first: a turn that can never run must not cost the
    # conversation its context (the engine would refuse it only after the drop).
    limit = (await ingress.info(model)).max_model_len
    if len(prompt_ids) + params.max_tokens > limit:
        raise ContextLengthExceededError(len(prompt_ids), params.max_tokens, limit)
    logger.info("context %s: rebuilding it (%d tokens): %s", cid, len(prompt_ids), why)
    op = ContextOp(cid, ContextAction.GENERATE, expected_tokens=0)
    for attempt in range(2):
        # Whatever is there goes first: a stale copy, or the mark of a dropped one (which
        # would answer the new context's first call with a 410). A first run has neither:
        # its read found nothing (and a read takes a dropped one's mark away).
        if stale:
            await free(ingress, model, cid)
        try:
            gen = await _generate(
                ingress, model, prompt_ids, params, tag, op, prompt_ids, busy_pauses, reasoning
            )
            return gen, 0
        except ShoalError as exc:
            if not _gone(exc) or attempt == 1:
                raise
            stale = True
    raise AssertionError("unreachable")


async def _generate(
    ingress: Ingress,
    model: str,
    new_ids: list[int],
    params: SamplingParams,
    tag: str,
    op: ContextOp,
    prompt_ids: list[int],
    busy_pauses: tuple[float | None, ...],
    reasoning: ReasoningFormat | None,
) -> Generation:
    """Start it; a context still busy for a moment (the generation of a run cancelled
    just before, which its replica has not yet let go of) is waited for briefly."""
    for pause in busy_pauses:
        try:
            return await ingress.generate(
                model, new_ids, params, [], tag, op, detok_prefix=prompt_ids, reasoning=reasoning
            )
        except ShoalError as exc:
            if exc.status_code != 409 or pause is None:
                raise
            await asyncio.sleep(pause)
    raise AssertionError("unreachable")


async def held_tokens(ingress: Ingress, model: str, cid: str) -> list[int] | None:
    """The context's tokens; None when no replica holds it (never made, dropped, or its
    replica gone)."""
    try:
        return await ingress.call(model, "context_tokens", ContextOp(cid, ContextAction.READ))
    except ShoalError as exc:
        if _gone(exc):
            return None
        raise


async def free(ingress: Ingress, model: str, cid: str) -> None:
    """Drop the context, where there is one (a deleted conversation, a rebuild)."""
    try:
        await ingress.call(model, "free_context", ContextOp(cid, ContextAction.FREE))
    except ShoalError as exc:
        if not _gone(exc):
            raise


def _gone(exc: ShoalError) -> bool:
    # By status, not class: a replica's error arrives as a ShoalError of its status.
    return exc.status_code in (404, 410)


def _extends(prompt_ids: list[int], held: list[int]) -> bool:
    # At least one new token: the context must compute something to give logits.
    return 0 < len(held) < len(prompt_ids) and prompt_ids[: len(held)] == held


def _why_rebuilt(held: list[int] | None) -> str:
    if held is None:
        return "no replica holds it (first run, replica restarted or scaled down, or dropped)"
    if not held:
        return "it is empty"
    return "the conversation no longer starts with what it holds (other instructions or model, or edited messages)"
