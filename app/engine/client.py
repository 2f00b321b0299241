"""EngineClient: the one interface the serving side uses to drive an engine.

Two implementations: `AsyncEngine` (the step loop in a thread of this process: tests,
benchmarks) and `EngineProcess` (the step loop in a child process: serving). A replica
holds one and never reaches past it into the LLMEngine.
"""

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from app.protocol.messages import EngineRequest
from app.protocol.outputs import ContextFile, EngineInfo, SlotInfo, TokenDelta


class EngineDeadError(RuntimeError):
    """The step loop has stopped; the replica should be replaced."""


class EngineUnavailableError(EngineDeadError):
    """The engine was already dead when this request came: it never saw it, so it may be
    sent to another replica (unlike one that was inside the engine when it died)."""


@runtime_checkable
class EngineClient(Protocol):
    """A running engine, driven from asyncio.

    Streaming contract of `generate`:
    - it yields the TokenDelta objects of one request, in order. Each of the request's
      outputs (`params.n` of them; one for a request on a context) ends with exactly
      one delta carrying a `finish_reason`; earlier deltas carry None. When every output
      has ended, the iterator ends.
    - a request the engine refuses raises before the first delta (a ShoalError: 400 for a
      bad request, 409 for a request id already streaming or a busy context, 404/410 for
      a missing or dropped context, 429 when contexts are at their limit). A failure of
      that request alone inside a step raises the error it carried (a ShoalError)
      mid-stream; nothing else on the engine is affected.
    - when the consumer stops early (breaks, is cancelled, closes the iterator), the
      request is aborted in the engine; its KV blocks are freed at once by the engine
      (AsyncEngine) or at its next message (EngineProcess).
    - with `request.context`, the request is a Fill or Generate on that context: its
      `prompt_token_ids` are the tokens it adds, and a Fill yields one delta whose token
      no one should show (it only ends the stream).
    - if the engine is dead before the request is sent, EngineUnavailableError (the
      request may go to another replica); if it dies while the request is inside it,
      EngineDeadError (it may have been the cause: no retry).

    Invariants:
    - `info` is set before the client is returned and never changes.
    - `is_alive` turns False once and stays False; every open stream then ends with
      EngineDeadError and every later call raises EngineUnavailableError or
      EngineDeadError.
    - queries (stats, slots, context lookups, free_context) wait for at most the step
      in progress; saves and restores read and write their files off the step loop, one
      at a time (so a quota check sees the file of the save before it), and stop the
      step loop only while KV blocks are copied.
    - `abort` and `shutdown` never raise; `abort` of an unknown or finished request id
      is a no-op.
    """

    info: EngineInfo

    @property
    def is_alive(self) -> bool: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]: ...

    def abort(self, request_id: str) -> None: ...

    def check_health(self, stuck_after_s: float = 60.0, stalled_after_s: float = 60.0) -> None:
        """Raise EngineDeadError when the engine is dead, has had work but finished no
        step for `stuck_after_s`, or has had requests waiting with nothing scheduled for
        `stalled_after_s`."""
        ...

    async def stats(self) -> dict:
        """EngineStats.as_dict(), current as of this call."""
        ...

    async def slots(self) -> list[SlotInfo]:
        """max(max_num_seqs, busy) seats: running requests, then waiting ones, in
        admission order, then idle seats."""
        ...

    async def context_tokens(self, context_id: str) -> list[int]:
        """The tokens a context holds (404 when it does not exist)."""
        ...

    async def free_context(self, context_id: str) -> int:
        """Drop a context; returns how many tokens it held (409 when busy)."""
        ...

    async def save_context(
        self, context_id: str, path: str, quota_bytes: int | None = None
    ) -> ContextFile:
        """Write a context's tokens and KV to `path` (an already checked path, see
        slot_files.checked_path); with `quota_bytes`, the files of `path`'s directory may
        not pass it (409). Returns tokens saved and bytes written."""
        ...

    async def restore_context(self, context_id: str, path: str) -> ContextFile:
        """Make the file at `path` the context `context_id` (replacing an idle one).
        Returns tokens restored and bytes of the file read."""
        ...

    async def set_lora(self, name: str, path: str | None) -> None:
        """Run the LoRA adapter at `path` as `name` (400 if it cannot be read or does not
        fit the model), or no more (None; 404 when unknown)."""
        ...

    def shutdown(self) -> None: ...
