"""ContextMoves: a replica's contexts leave with it, and come back where their next call
lands.

When Serve drains a ModelServer replica (a scale-down, a rolling update), it waits for
the replica's ongoing requests, then calls its destructor. There each context the replica
holds is saved in the slot-file format (app/engine/slot_files.py: its tokens and the KV
of the computed ones) and handed to the app's RoutingState actor, which puts it in Ray's
object store (the actor owns it, so it outlives this replica) and parks it; its pin goes
(routing_state.py). The next call that names it goes where the router's usual choice
sends it; that replica does not hold it, takes it from the RoutingState and restores it
before the call runs, so the call computes only its new tokens. A context nobody calls
again stays parked until it expires.

An operator moves a live replica's context the same way (`move`, from
deployments/context_rebalance.py): it is saved, parked pinned to the replica it goes to,
and freed here; its next call goes there and restores it. Calls on it here wait for the
move; one that still arrives here after it (an ingress's stale pin) brings it back.

The RoutingState lends a parked context to the replica that restores it and drops it
only once that replica says the restore went: a failed or cancelled restore leaves it
parked for the next call. A drained replica's copy is not parked over a context made
again elsewhere meanwhile (that one is what its calls now use).

The contexts a replica holds are those its calls made (`seen`), less those freed: the
engine may also have dropped some for its limits, and their save then fails and is
skipped. A replica whose engine died cannot save anything: its contexts are lost, as
before (a call then recomputes or gets the engine's 404/410).
"""

import asyncio
import contextlib
import logging
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from app.engine.client import EngineClient
from app.protocol.errors import (
    CapacityError,
    NotFoundError,
    NotImplementedByServerError,
    OverloadedError,
    ShoalError,
)
from app.protocol.messages import ContextOp
from deployments.routing_state import SharedRouting

logger = logging.getLogger("ray.serve")


class ContextMoves:
    def __init__(self, engine: EngineClient, shared: SharedRouting | None, replica: str) -> None:
        self.engine, self.shared, self.replica = engine, shared, replica
        self.held: set[str] = set()
        # A context being restored here or moved away: calls on it wait for that.
        self._busy: dict[str, asyncio.Lock] = {}

    def seen(self, op: ContextOp | None) -> None:
        if op is not None and op.action.creates:
            self.held.add(op.context_id)

    def freed(self, context_id: str) -> None:
        self.held.discard(context_id)
        if self.shared is not None:  # an operator's rebalance counts only live contexts
            self.shared.freed(context_id, self.replica)

    async def bring(self, op: ContextOp | None) -> None:
        """Before a call on `op`'s context (or the parent a new child forks): if this
        replica does not hold it and a drained replica parked it, restore it here."""
        if op is None or self.shared is None:
            return
        for context in (op.context_id, op.parent_context_id):
            if context is None or (context in self.held and context not in self._busy):
                continue
            async with self._hold(context):  # a second call waits for the first's restore
                if context not in self.held:
                    await self._restore(context)

    @contextlib.asynccontextmanager
    async def _hold(self, context: str) -> AsyncIterator[None]:
        lock = self._busy.setdefault(context, asyncio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and self._busy.get(context) is lock:
                del self._busy[context]

    async def _restore(self, context: str) -> None:
        """Take the parked context (lent by the RoutingState until this says how the
        restore went: a failure parks it again for the next call, never loses it)."""
        assert self.shared is not None
        data = await self.shared.unpark(context, self.replica)
        if data is None:
            return
        try:
            with tempfile.TemporaryDirectory(prefix="shoal-move-") as directory:
                path = Path(directory) / "context.slot"
                await asyncio.to_thread(path.write_bytes, data)
                moved = await self.engine.restore_context(context, str(path))
        except CapacityError:  # no room here now: parked again for a later call
            self.shared.returned(context)
            raise
        except ShoalError as exc:  # another model's (an app redeployed): not ours
            logger.warning("parked context %s dropped: %s", context, exc)
            self.shared.taken(context)
            return
        except BaseException:  # the engine failed, the call was cancelled...
            self.shared.returned(context)
            raise
        self.held.add(context)
        self.shared.taken(context)
        logger.info("context %s moved here: %d tokens", context, moved.num_tokens)

    async def move(self, context: str, to: str) -> int:
        """Send a context held here to replica `to` (an operator's move); its tokens."""
        if self.shared is None:
            raise NotImplementedByServerError("contexts cannot move: the app has no routing state")
        async with self._hold(context):
            if context not in self.held:
                raise NotFoundError(f"context {context!r} is not held here", "context_id")
            with tempfile.TemporaryDirectory(prefix="shoal-move-") as directory:
                path = Path(directory) / "context.slot"
                saved = await self.engine.save_context(context, str(path))  # busy: 409
                data = await asyncio.to_thread(path.read_bytes)
            if not await self.shared.park(context, data, to, self.replica):
                raise OverloadedError("the routing state did not take the context: retry")
            try:
                await self.engine.free_context(context)
            except Exception:  # busy after all: it stays here, taken back
                await self.shared.unpark(context, self.replica)
                self.shared.taken(context)
                raise
            self.held.discard(context)
        logger.info("context %s moved to %s: %d tokens", context, to, saved.num_tokens)
        return saved.num_tokens

    async def send_away(self) -> int:
        """Park every context held here (the replica is draining); how many were."""
        if self.shared is None or self.shared.handle() is None:
            return 0  # nowhere to park them: not worth saving
        parked = 0
        with tempfile.TemporaryDirectory(prefix="shoal-move-") as directory:
            path = Path(directory) / "context.slot"
            for context in sorted(self.held):
                try:
                    await self.engine.save_context(context, str(path))
                except Exception as exc:  # dropped for the engine's limits, or TP > 1
                    logger.info("context %s stays behind: %s", context, exc)
                    continue
                data = await asyncio.to_thread(path.read_bytes)
                parked += await self.shared.park(context, data, None, self.replica)
        logger.info("%d of %d contexts parked for other replicas", parked, len(self.held))
        return parked
