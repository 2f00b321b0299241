"""From a model replica's token deltas to text: per-output detokenization, stop strings,
usage counts and logprobs. Used by every dialect's routes."""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from app.protocol.errors import OverloadedError, RemoteError
from app.protocol.messages import ContextOp, EngineErrorMessage, GenerateRequest
from app.protocol.outputs import TokenDelta, TokenLogprob
from app.protocol.sampling import SamplingParams
from app.text.detokenizer import IncrementalDetokenizer
from app.text.stop import StopStrings

logger = logging.getLogger("ray.serve")


def replica_failure(exc: Exception) -> EngineErrorMessage:
    """The error event for a stream whose replica call failed."""
    if isinstance(exc, RayActorError):  # stopped (shutdown, update), crashed, node lost
        message = (
            "the model replica serving this request stopped before it finished (it was shut "
            "down, restarted or lost its node); retry the request"
        )
    else:
        message = f"the model replica failed: {type(exc).__name__}: {exc}"
    return EngineErrorMessage(503, "service_unavailable", message)


class StreamError(Exception):
    def __init__(self, error: EngineErrorMessage) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class OutputState:
    index: int
    detok: IncrementalDetokenizer
    stops: StopStrings
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class TextDelta:
    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    token_ids: tuple[int, ...] = ()


class Generation:
    """One request in flight: iterate `deltas()` for text pieces; `outputs` fill up."""

    def __init__(
        self,
        handle: Any,
        tokenizer: Any,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: list[str],
        request_id: str | None = None,
        timer: Any = None,
        context: ContextOp | None = None,
        detok_prefix: list[int] | None = None,
    ) -> None:
        """`detok_prefix`: the tokens the text continues (default: the prompt)."""
        self.request_id = request_id or uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_ids = prompt_ids
        self.params = params
        self.outputs = [
            OutputState(
                i,
                IncrementalDetokenizer(
                    tokenizer, prompt_ids if detok_prefix is None else detok_prefix
                ),
                StopStrings(stop),
            )
            for i in range(params.n)
        ]
        self._stream = handle.generate.remote(
            GenerateRequest(self.request_id, prompt_ids, params, context)
        )
        self._first: TokenDelta | EngineErrorMessage | None = None
        self._timer = timer  # TokenTimer or None
        self.first_token_at: float | None = None  # perf_counter of the first token
        self.cached_tokens = 0  # prompt tokens the replica found in its prefix cache

    @property
    def completion_tokens(self) -> int:
        return sum(o.num_tokens for o in self.outputs)

    async def start_or_raise(self) -> None:
        """`start`, with an engine's refusal raised as the ShoalError it was."""
        try:
            await self.start()
        except StreamError as exc:
            e = exc.error
            raise RemoteError(e.status_code, e.error_type, e.message, e.param) from None

    async def start(self) -> None:
        """Wait for the first item so that a refusal becomes a proper HTTP error."""
        try:
            self._first = await self._stream.__anext__()
        except RayActorError as exc:  # the chosen replica died before its first token
            raise StreamError(replica_failure(exc)) from exc
        except BackPressureError as exc:
            # Serve installs its own plain-text handler for this error in the ingress app,
            # so it is turned into ours here, where the handle call is made.
            raise OverloadedError(
                f"model is overloaded: {exc.message} Retry later.",
                exc.status_code,
                exc.retry_after_s or 1.0,
            ) from None
        if isinstance(self._first, EngineErrorMessage):
            raise StreamError(self._first)

    def cancel(self) -> None:
        self._stream.cancel()

    async def deltas(self) -> AsyncIterator[TextDelta]:
        items = self._items()
        async for item in items:
            if isinstance(item, EngineErrorMessage):
                raise StreamError(item)
            out = self.outputs[item.index]
            if out.finish_reason is not None:
                continue  # already cut by a stop string
            out.num_tokens += len(item.token_ids)
            self.cached_tokens = max(self.cached_tokens, item.num_cached_tokens)
            if self.first_token_at is None and item.token_ids:
                self.first_token_at = time.perf_counter()
            if self._timer is not None and item.token_ids:
                self._timer.tokens(len(item.token_ids))
            text = out.stops.feed(out.detok.add(item.token_ids))
            lps = list(item.logprobs or ())
            out.logprobs.extend(lps)
            reason = None
            if out.stops.stopped:
                reason = "stop"
            elif item.finish_reason is not None:
                text += out.stops.feed(out.detok.flush())
                text += out.stops.flush()
                reason = "stop" if out.stops.stopped else item.finish_reason.value
                if reason == "abort":
                    reason = "stop"
            out.text += text
            if reason is not None:
                out.finish_reason = reason
            if text or reason or lps:
                yield TextDelta(item.index, text, lps, reason, item.token_ids)
            if all(o.finish_reason is not None for o in self.outputs):
                self.cancel()  # stop strings ended every output: free the engine's blocks
                return

    async def _items(self) -> AsyncIterator[TokenDelta | EngineErrorMessage]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        try:
            async for item in self._stream:
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # the replica died mid-stream, or its call failed
            logger.warning("request %s: stream from its replica broke: %r", self.request_id, exc)
            raise StreamError(replica_failure(exc)) from exc
