"""One request in flight, from a model replica's token deltas to text: per-output
detokenization, stop strings, usage counts and logprobs. Every dialect's routes use it,
through `Ingress.generate` (which also times and counts it).

A Generation owns its replica call from start to end: however its consumer stops (done,
an error, the client gone, the task cancelled while it waits for the first token or
anywhere after), the call is cancelled, and with it the request in the engine. A request
whose replica turns out dead before its first token is sent again (the router has
dropped that replica by then), unless it names a context, which died with the replica.

A reasoning model's output (given its `ReasoningFormat`) is split as it is read: the
thinking goes aside (`OutputState.thinking`, `TextDelta.thinking`), and only the answer
reaches the stop strings and `text`, so that tool-call parsing and every dialect's
content see the answer alone; token counts are the whole output's.

One failure, one type: a refusal before the first token and a failure after it are both
a ShoalError (RemoteError for what the replica reported), which the error handler maps
to the dialect's JSON and a stream body to the dialect's error event.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from app.protocol.errors import OverloadedError, RemoteError, ShoalError
from app.protocol.messages import EngineErrorMessage, EngineRequest
from app.protocol.outputs import TokenDelta, TokenLogprob
from app.text.detokenizer import IncrementalDetokenizer
from app.text.reasoning import ReasoningFormat, ReasoningStream
from app.text.stop import StopStrings
from deployments.http.metrics import TokenTimer

logger = logging.getLogger("ray.serve")

RETRIES_BEFORE_FIRST_TOKEN = 2
RETRY_PAUSE_S = 0.5
# What a replica whose engine is dead answers (see ModelServer): safe to send elsewhere.
ENGINE_UNAVAILABLE = "engine_unavailable"


def replica_failure(exc: Exception) -> RemoteError:
    """The error of a request whose replica call failed."""
    if isinstance(exc, RayActorError):  # stopped (shutdown, update), crashed, node lost
        message = (
            "the model replica serving this request stopped before it finished (it was shut "
            "down, restarted or lost its node); retry the request"
        )
    else:
        message = f"the model replica failed: {type(exc).__name__}: {exc}"
    return RemoteError(503, "service_unavailable", message, None)


def overloaded(exc: BackPressureError) -> OverloadedError:
    """Serve's refusal of a handle call when the deployment's queue is full. Serve installs
    its own plain-text handler for it in the ingress app, so it is turned into ours where
    the call is made."""
    return OverloadedError(
        f"model is overloaded: {exc.message} Retry later.",
        exc.status_code,
        exc.retry_after_s or 1.0,
    )


def as_error(message: EngineErrorMessage) -> RemoteError:
    return RemoteError(message.status_code, message.error_type, message.message, message.param)


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


@dataclass
class OutputState:
    """One of the request's `n` outputs so far."""

    index: int
    detok: IncrementalDetokenizer
    stops: StopStrings
    reasoning: ReasoningStream | None = None  # a reasoning model's: splits the thinking
    text: str = ""  # the answer (all of the output, unless it was split)
    thinking: str = ""
    reasoning_tokens: int = 0  # of num_tokens, those that came while it was thinking
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def reasoned(self) -> bool:
        """Whether the output had a thinking block (perhaps empty)."""
        return self.reasoning is not None and self.reasoning.reasoned

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """New output text as (thinking, answer so far, before stop strings)."""
        if self.reasoning is None:
            return "", text
        return self.reasoning.feed(text, final)


@dataclass
class TextDelta:
    index: int
    text: str  # the answer's new text
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    token_ids: tuple[int, ...] = ()
    thinking: str = ""  # the thinking's new text (a reasoning model's)


class Generation:
    """Iterate `deltas()` for text pieces, or `drain()`; `outputs` fill up either way."""

    def __init__(
        self,
        handle: Any,
        tokenizer: Any,
        request: EngineRequest,
        stop: list[str],
        timer: TokenTimer,
        detok_prefix: list[int] | None = None,
        reasoning: ReasoningFormat | None = None,
    ) -> None:
        """`handle`: the model's streaming handle. `detok_prefix`: the tokens the text
        continues (default: the prompt). `reasoning`: how a reasoning model's output
        splits into thinking and answer (None: all answer)."""
        self.request_id = request.request_id
        self.created = int(time.time())
        self.prompt_ids = request.prompt_token_ids
        self.params = request.params
        prefix = self.prompt_ids if detok_prefix is None else detok_prefix
        self.outputs = [
            OutputState(
                i,
                IncrementalDetokenizer(tokenizer, prefix),
                StopStrings(stop),
                None if reasoning is None else ReasoningStream(reasoning),
            )
            for i in range(request.params.n)
        ]
        self._handle = handle
        self._request = request
        self._stream = handle.generate.remote(request)
        self._first: TokenDelta | None = None
        self._timer = timer
        self.cached_tokens = 0  # prompt tokens the replica found in its prefix cache

    @property
    def completion_tokens(self) -> int:
        return sum(o.num_tokens for o in self.outputs)

    def timings(self) -> dict[str, float]:
        """llama.cpp's `timings`: the prompt's part (to the first token; cached tokens
        are not processed) and the generation's (from it to the last token so far)."""
        t = self._timer
        first = t.first_at or time.perf_counter()
        last = t.last or first
        prompt_n = max(len(self.prompt_ids) - self.cached_tokens, 0)
        prompt_ms = 1000 * (first - t.started)
        predicted_n = self.completion_tokens
        # The first token comes with the prompt's step: the generation's time is the rest.
        predicted_ms = 1000 * (last - first)
        steps = max(predicted_n - 1, 0)
        return {
            "cache_n": self.cached_tokens,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
            "predicted_per_second": 1000 * steps / predicted_ms if predicted_ms else 0.0,
        }

    def prompt_progress(self, held: int = 0) -> dict[str, float]:
        """llama.cpp's `prompt_progress`, once the prompt is in (the engine does not
        report a prefill part way through); `held`: tokens a context held before it."""
        total = held + len(self.prompt_ids)
        return {
            "total": total,
            "cache": held + self.cached_tokens,
            "processed": total,
            "time_ms": self.timings()["prompt_ms"],
        }

    @property
    def first_token_at(self) -> float | None:
        """perf_counter of the first token, once it came."""
        return self._timer.first_at

    async def start(self) -> None:
        """Wait for the first item, so that a refusal is raised (as a ShoalError) before
        any byte of the response is sent."""
        try:
            first = await self._first_item()
        except BackPressureError as exc:
            # Nothing was sent, so there is nothing to cancel (and cancelling would raise
            # it again).
            raise overloaded(exc) from None
        except BaseException:  # cancelled while waiting (client gone), or refused
            self.cancel()
            raise
        if isinstance(first, EngineErrorMessage):
            self.cancel()
            raise as_error(first)
        self._arrived(first)
        self._first = first

    async def _first_item(self) -> TokenDelta | EngineErrorMessage:
        retryable = self._request.context is None
        for attempt in range(RETRIES_BEFORE_FIRST_TOKEN + 1):
            last = attempt == RETRIES_BEFORE_FIRST_TOKEN or not retryable
            try:
                first = await self._stream.__anext__()
                if type(first) is tuple:  # a TokenDelta's wire form
                    first = TokenDelta.from_wire(self.request_id, first)
            except RayActorError as exc:  # the chosen replica died before its first token
                if last:
                    raise replica_failure(exc) from exc
                logger.warning("request %s: replica lost, sending it again", self.request_id)
            else:
                unavailable = (
                    isinstance(first, EngineErrorMessage) and first.error_type == ENGINE_UNAVAILABLE
                )
                if not unavailable or last:
                    return first
                logger.warning("request %s: %s; sending it again", self.request_id, first.message)
            # By then the dead replica has left and the router has dropped it.
            await asyncio.sleep(RETRY_PAUSE_S * (attempt + 1))
            self._stream = self._handle.generate.remote(self._request)
        raise AssertionError("unreachable")

    def cancel(self) -> None:
        cancel_call(self._stream)

    async def drain(self) -> None:
        """Run to the end (non-streamed responses read `outputs` after)."""
        async for _ in self.deltas():
            pass

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
        async for item in self._items():
            if isinstance(item, EngineErrorMessage):
                raise as_error(item)
            out = self.outputs[item.index]
            if out.finish_reason is not None:
                continue  # already cut by a stop string
            out.token_ids.extend(item.token_ids)
            self.cached_tokens = max(self.cached_tokens, item.num_cached_tokens)
            delta = self._advance(out, item)
            if delta is not None:
                yield delta
            if all(o.finish_reason is not None for o in self.outputs):
                self.cancel()  # stop strings ended every output: free the engine's blocks
                return

    @staticmethod
    def _advance(out: OutputState, item: TokenDelta) -> TextDelta | None:
        """Feed one delta through the detokenizer, the reasoning split and the stop
        strings (which see the answer only)."""
        was_inside = out.reasoning is not None and out.reasoning.state != "after"
        thinking, answer = out.split(out.detok.add(item.token_ids), final=False)
        text = out.stops.feed(answer)
        lps = list(item.logprobs or ())
        out.logprobs.extend(lps)
        reason = None
        if out.stops.stopped:
            reason = "stop"
        elif item.finish_reason is not None:
            more, answer = out.split(out.detok.flush(), final=True)
            thinking += more
            text += out.stops.feed(answer)
            text += out.stops.flush()
            reason = "stop" if out.stops.stopped else item.finish_reason.value
            if reason == "abort":
                reason = "stop"
        if was_inside and (out.reasoned or thinking):
            out.reasoning_tokens += len(item.token_ids)
        out.text += text
        out.thinking += thinking
        if reason is not None:
            out.finish_reason = reason
        if text or thinking or reason or lps:
            return TextDelta(out.index, text, lps, reason, item.token_ids, thinking)
        return None

    def _arrived(self, item: TokenDelta) -> None:
        """Time and count tokens as they arrive (TTFT, inter-token latency), not as the
        consumer reads them."""
        if item.token_ids:
            self._timer.tokens(len(item.token_ids))

    async def _items(self) -> AsyncIterator[TokenDelta | EngineErrorMessage]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        try:
            async for item in self._stream:
                if type(item) is tuple:  # a TokenDelta's wire form
                    item = TokenDelta.from_wire(self.request_id, item)
                    self._arrived(item)
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except ShoalError:
            raise
        except Exception as exc:  # the replica died mid-stream, or its call failed
            logger.warning("request %s: stream from its replica broke: %r", self.request_id, exc)
            raise replica_failure(exc) from exc
