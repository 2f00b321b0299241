"""Offline generation: prompts in, complete outputs out, on one engine, no threads.

Every prompt is queued at once and the engine is stepped until it has no work, so the
prompts batch continuously. Deltas of other requests (an engine shared with a front-end)
are ignored.
"""

import uuid
from collections.abc import Sequence
from typing import Protocol

from app.protocol.outputs import CompletionOutput, RequestOutput, TokenDelta
from app.protocol.sampling import SamplingParams


class Steppable(Protocol):
    """What offline generation needs of an engine (LLMEngine's own methods)."""

    has_work: bool

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None: ...

    def step(self) -> list[TokenDelta]: ...


def generate(
    engine: Steppable,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
) -> list[RequestOutput]:
    """Run prompts to completion; results in prompt order."""
    params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    results: dict[str, RequestOutput] = {}
    for prompt, p in zip(prompts, params_list, strict=True):
        rid = uuid.uuid4().hex
        engine.add_request(rid, prompt, p)
        results[rid] = RequestOutput(rid, list(prompt), [CompletionOutput(i) for i in range(p.n)])
    while engine.has_work:
        for delta in engine.step():
            if delta.request_id in results:
                _apply(results[delta.request_id], delta)
    return list(results.values())  # dicts keep insertion order: prompt order


def _apply(result: RequestOutput, delta: TokenDelta) -> None:
    out = result.outputs[delta.index]
    out.token_ids.extend(delta.token_ids)
    if delta.logprobs:
        out.logprobs = (out.logprobs or []) + list(delta.logprobs)
    if delta.finish_reason is not None:
        out.finish_reason = delta.finish_reason
