"""From a model replica's token deltas to text: per-output detokenization, stop strings,
usage counts and logprobs. Used by every dialect's routes.

A Generation owns its replica call from start to end: however its consumer stops (done,
an error, the client gone, the task cancelled while it waits for the first token or
anywhere after), the call is cancelled, and with it the request in the engine. A request
whose replica turns out dead before its first token is sent again (the router has
dropped that replica by then), unless it names a context, which died with the replica.
"""

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
from app.protocol.messages import ContextOp, EngineErrorMessage, EngineRequest
from app.protocol.outputs import TokenDelta, TokenLogprob
from app.protocol.sampling import SamplingParams
from app.text.detokenizer import IncrementalDetokenizer
from app.text.stop import StopStrings

logger = logging.getLogger("ray.serve")

RETRIES_BEFORE_FIRST_TOKEN = 2
RETRY_PAUSE_S = 0.5
# What a replica whose engine is dead answers (see ModelServer): safe to send elsewhere.
ENGINE_UNAVAILABLE = "engine_unavailable"


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


def cancel_call(stream: Any) -> None:
    """Cancel a streaming handle call, wherever it is. Serve's `cancel` misses one case:
    a call already sent to a replica whose caller was cancelled before it read which
    one (the replica then generates for no one until it ends)."""
    stream.cancel()
    sent = getattr(stream, "_replica_result_future", None)
    if (
        getattr(stream, "_replica_result", None) is None
        and isinstance(sent, asyncio.Future)
        and sent.done()
        and not sent.cancelled()
        and sent.exception() is None
    ):
        sent.result().cancel()


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
        self._handle = handle
        self._request = EngineRequest(self.request_id, prompt_ids, params, context)
        self._stream = handle.generate.remote(self._request)
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
            for attempt in range(RETRIES_BEFORE_FIRST_TOKEN + 1):
                last = attempt == RETRIES_BEFORE_FIRST_TOKEN
                try:
                    self._first = await self._stream.__anext__()
                except RayActorError as exc:  # the chosen replica died before its first token
                    if last or self._request.context is not None:
                        raise StreamError(replica_failure(exc)) from exc
                    logger.warning("request %s: replica lost, sending it again", self.request_id)
                else:
                    first = self._first
                    if not (
                        isinstance(first, EngineErrorMessage)
                        and first.error_type == ENGINE_UNAVAILABLE
                        and not last
                        and self._request.context is None
                    ):
                        break
                    logger.warning(
                        "request %s: %s; sending it again", self.request_id, first.message
                    )
                # By then the dead replica has left and the router has dropped it.
                await asyncio.sleep(RETRY_PAUSE_S * (attempt + 1))
                self._stream = self._handle.generate.remote(self._request)
        except BackPressureError as exc:
            # Serve installs its own plain-text handler for this error in the ingress app,
            # so it is turned into ours here, where the handle call is made.
            raise OverloadedError(
                f"model is overloaded: {exc.message} Retry later.",
                exc.status_code,
                exc.retry_after_s or 1.0,
            ) from None
        except BaseException:  # cancelled while waiting (client gone), or refused
            self.cancel()
            raise
        if isinstance(self._first, EngineErrorMessage):
            raise StreamError(self._first)

    def cancel(self) -> None:
        cancel_call(self._stream)

    async def deltas(self) -> AsyncIterator[TextDelta]:
        """Text pieces until every output ends; the replica call is cancelled however
        this ends early (an error, the consumer cancelled or gone)."""
        try:
            async for delta in self._text_deltas():
                yield delta
        finally:
            if any(o.finish_reason is None for o in self.outputs):
                self.cancel()

    async def _text_deltas(self) -> AsyncIterator[TextDelta]:
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
