"""StubEngine: an EngineClient with no model, for measuring Serve alone (bench/serve_capacity.py).

It keeps the engine's shape where the serving side can tell: a step loop in its own
thread gives every open request one token per step, a step every 1/`tokens_per_s`
seconds, and hands each step's deltas over at once through the same DeltaStreams an
EngineProcess's reader thread uses. The tokens are a fixed English text in the model's
own tokenizer, from its start for every request, so that the ingress detokenizes real
text; every output runs to `max_tokens` (finish reason "length").

`StubModelServerDeployment` is the ModelServer deployment over it, with `set_rate` to
change the rate while the app runs. Only `build_app(config, model_server=...)` in a
benchmark or test reaches it: nothing in a config can name it.
"""

import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from app.engine.client import EngineUnavailableError
from app.engine.stats import EngineStats
from app.engine.streams import DeltaStreams
from app.protocol.errors import NotImplementedByServerError
from app.protocol.messages import EngineRequest
from app.protocol.outputs import ContextFile, EngineInfo, FinishReason, SlotInfo, TokenDelta
from deployments.config import ModelDeploymentConfig
from deployments.model_server import ModelServer

TEXT = (
    "The tide rises and falls twice a day because the moon pulls the oceans toward it, "
    "and the earth turns beneath that bulge of water. When the sun and the moon line up, "
    "their pulls add and the tides run high; when they stand at right angles, the tides "
    "are small. Coasts shape the rest: a wide bay can funnel the water into a bore. "
)


def text_ids(tokenizer: Any) -> list[int]:
    """The tokens every request's output cycles through."""
    return tokenizer.encode(TEXT, add_special_tokens=False)


def output_text(tokenizer: Any, max_tokens: int) -> str:
    """The whole text of one request's output."""
    ids = text_ids(tokenizer)
    return tokenizer.decode([ids[i % len(ids)] for i in range(max_tokens)])


@dataclass
class _Open:
    request: EngineRequest
    sent: int = 0  # tokens per output so far


class StubEngine:
    """One token per open request per step, `tokens_per_s` steps a second (0: paused)."""

    def __init__(self, token_ids: list[int], tokens_per_s: float, max_model_len: int) -> None:
        self.info = EngineInfo("stub", max_model_len)
        self.tokens_per_s = tokens_per_s
        self._ids = token_ids
        self._streams = DeltaStreams()
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()
        self._generated = 0
        self._stopping = threading.Event()
        threading.Thread(target=self._loop, name="stub-step-loop", daemon=True).start()

    @property
    def is_alive(self) -> bool:
        return not self._stopping.is_set()

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        if not self.is_alive:
            raise EngineUnavailableError("stub engine stopped")
        rid = request.request_id
        queue = self._streams.open(rid)
        with self._lock:
            self._open[rid] = _Open(request)
        deltas = self._streams.iterate(rid, queue, request.params.n, lambda: self.abort(rid))
        async for delta in deltas:
            yield delta

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._open.pop(request_id, None)

    def _loop(self) -> None:
        next_step = time.monotonic()
        while not self._stopping.is_set():
            rate = self.tokens_per_s
            if rate <= 0:
                self._stopping.wait(0.05)
                next_step = time.monotonic()
                continue
            next_step += 1.0 / rate
            self._streams.dispatch(self._step())
            self._stopping.wait(max(0.0, next_step - time.monotonic()))

    def _step(self) -> list[TokenDelta]:
        deltas = []
        with self._lock:
            for rid, state in list(self._open.items()):
                params = state.request.params
                token = self._ids[state.sent % len(self._ids)]
                state.sent += 1
                last = state.sent >= params.max_tokens
                reason = FinishReason.LENGTH if last else None
                prompt = len(state.request.prompt_token_ids)
                deltas += [
                    TokenDelta(rid, i, (token,), None, reason, prompt) for i in range(params.n)
                ]
                if last:
                    del self._open[rid]
        self._generated += len(deltas)
        return deltas

    def check_health(self, stuck_after_s: float = 60.0, stalled_after_s: float = 60.0) -> None:
        if not self.is_alive:
            raise EngineUnavailableError("stub engine stopped")

    async def stats(self) -> dict:
        return EngineStats(
            num_running=len(self._open), num_generated_tokens=self._generated
        ).as_dict()

    async def slots(self) -> list[SlotInfo]:
        return []

    async def context_tokens(self, context_id: str) -> list[int]:
        raise NotImplementedByServerError("the stub engine holds no contexts")

    async def free_context(self, context_id: str) -> int:
        raise NotImplementedByServerError("the stub engine holds no contexts")

    async def save_context(
        self, context_id: str, path: str, quota_bytes: int | None = None
    ) -> ContextFile:
        raise NotImplementedByServerError("the stub engine holds no contexts")

    async def restore_context(self, context_id: str, path: str) -> ContextFile:
        raise NotImplementedByServerError("the stub engine holds no contexts")

    def shutdown(self) -> None:
        self._stopping.set()


class StubModelServer(ModelServer):
    """The ModelServer replica, over a StubEngine speaking the model's tokenizer."""

    def __init__(self, config: ModelDeploymentConfig, registry: object = None) -> None:
        from app.models.source import resolve_model
        from app.text.tokenizer import load_tokenizer

        ids = text_ids(load_tokenizer(resolve_model(config.engine.model)))
        max_len = config.engine.max_model_len or 8192
        super().__init__(config, registry, engine=StubEngine(ids, 0.0, max_len))

    def set_rate(self, tokens_per_s: float) -> None:
        """Tokens per second per open request from now on."""
        self.engine.tokens_per_s = tokens_per_s


StubModelServerDeployment = serve.deployment(
    StubModelServer, name="ModelServer", health_check_period_s=5
)
