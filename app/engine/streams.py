"""DeltaStreams: per-request asyncio queues fed by a producer thread.

The producer (an engine step loop, or the reader of an engine process's pipe) hands over
each step's deltas at once; consumers on any event loop iterate their own request's.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from app.protocol.errors import ConflictError, RemoteError
from app.protocol.outputs import TokenDelta


class DeltaStreams:
    def __init__(self) -> None:
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    def __len__(self) -> int:
        return len(self._queues)

    def open(self, request_id: str) -> asyncio.Queue:
        """A queue for a new request; an id already streaming is refused, so that a
        second stream never takes the first one's deltas."""
        if request_id in self._queues:
            raise ConflictError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        return queue

    def close(self, request_id: str, queue: asyncio.Queue | None = None) -> None:
        """Forget a request's queue (only `queue`, when given: never a newer stream's)."""
        if queue is None or self._queues.get(request_id, (None, None))[1] is queue:
            self._queues.pop(request_id, None)

    async def iterate(
        self, request_id: str, queue: asyncio.Queue, num_outputs: int, abort: Callable[[], None]
    ) -> AsyncIterator[TokenDelta]:
        """Yield until each of the request's outputs has finished; an exception put on the
        queue is raised. A consumer that stops early aborts the request."""
        open_outputs = num_outputs
        try:
            while open_outputs:
                item = await queue.get()
                if isinstance(item, BaseException):
                    open_outputs = 0  # the engine already forgot it
                    raise item
                if item.error is not None:  # the engine ended this request alone
                    open_outputs = 0
                    e = item.error
                    raise RemoteError(e.status_code, e.error_type, e.message, e.param)
                if item.finish_reason is not None:
                    open_outputs -= 1
                yield item
        finally:
            self.close(request_id, queue)
            if open_outputs:
                abort()

    # ---- producer side (any thread) -------------------------------------------------
    def dispatch(self, deltas: list[TokenDelta]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for delta in deltas:
            target = self._queues.get(delta.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], delta))
        for loop, items in by_loop.items():
            _call_soon(loop, items)

    def fail(self, request_id: str, error: BaseException) -> None:
        target = self._queues.get(request_id)
        if target is not None:
            _call_soon(target[0], [(target[1], error)])

    def fail_all(self, error: BaseException) -> None:
        for loop, queue in list(self._queues.values()):
            _call_soon(loop, [(queue, error)])


def _call_soon(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, object]]) -> None:
    # A closed event loop raises RuntimeError: its consumers are gone anyway.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
