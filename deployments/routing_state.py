"""RoutingState: the routing knowledge every ingress shares, in one place.

Each model deployment's AffinityRouter (one per ingress process) learns two things: which
replica holds each context (ContextPins) and where each prompt prefix was sent
(PrefixIndex). Kept per process, a second ingress replica would not know the contexts
the first created, and a restarted one would know none. So each router writes what it
learns to one small Ray actor per application, and reads from it what it does not know:

- a context pin is sent when the context is created (at once: the next call may come
  through another ingress); a call whose context has no live pin here asks the actor
  before it falls back to the usual choice (an ingress restart loses nothing);
- prefix block keys are sent in batches (`FLUSH_S`); the actor is asked for a match
  only when another router has written lately (`others`): one ingress never waits on it;
- with other routers about, a call that may create a context claims it at the actor
  (the first claim wins), so two ingresses creating one context at once agree on where,
  and every context call asks it where the context is (an operator may have moved it);
- a replica that frees a context says so (`forget`), so an operator's rebalance
  (`plan`, context_rebalance.py) counts only the contexts replicas hold.

The local maps stay the cache: a pin or prefix known here costs no round trip. The app's
EngineRegistry starts the actor, detached: a redeployment replaces every replica of the
app, the registry's too, and the contexts parked for the new replicas
(context_moves.py) must outlive them; a later registry finds the same actor by its name.
It holds at most a few maps and the parked contexts, which expire (`PARKED_S`); it stays
until the Ray cluster goes. Without it (an app built without a registry) a router keeps
to what it knows itself: each call to it is bounded by `TIMEOUT_S` and its failure
means "unknown".
"""

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray

from deployments.context_pins import ContextPins
from deployments.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)
NAMESPACE = "shoal"
FLUSH_S = 0.1  # prefix keys wait at most this long to be sent
TIMEOUT_S = 1.0  # a read that takes longer counts as unknown
PARK_S = 10.0  # a context's bytes may take longer to hand over
ACTIVE_S = 60.0  # a router that wrote this recently counts as another ingress
LOOKUP_EVERY_S = 5.0  # a missing actor is looked for again after this long
PARKED_S = 3600.0  # a parked context nobody called for this long is dropped
LENT_S = 30.0  # a parked context lent to a replica that never said how its restore went
VERSION = 2  # in the actor's name: a detached actor of older code is not reused


def actor_name(app: str) -> str:
    return f"routing:v{VERSION}:{app}"


class RoutingState:
    """The shared maps, per model deployment. Plain Python: the actor's methods run one
    at a time."""

    def __init__(self) -> None:
        self.pins: dict[str, ContextPins] = {}
        self.prefixes: dict[str, PrefixIndex] = {}
        self.writers: dict[str, float] = {}  # router id -> when it last wrote
        # (deployment, context) -> ([ObjectRef] of a context that left its replica:
        # slot-file bytes owned by this actor, so they outlive the replica that wrote
        # them; when parked; when lent to a restoring replica, 0.0 if not)
        self.parked: dict[tuple[str, str], tuple[list, float, float]] = {}

    def _index(self, deployment: str, max_blocks: int) -> PrefixIndex:
        if deployment not in self.prefixes:  # keys only: the block size is the routers'
            self.prefixes[deployment] = PrefixIndex(block_size=1, max_blocks=max_blocks)
        return self.prefixes[deployment]

    def push(
        self,
        router: str,
        deployment: str,
        pins: Sequence[tuple[str, str]] = (),
        prompts: Sequence[tuple[Sequence[int], str]] = (),
        max_blocks: int = 50_000,
    ) -> int:
        """Record what a router learned; returns how many other routers wrote lately."""
        now = time.monotonic()
        self.writers[router] = now
        held = self.pins.setdefault(deployment, ContextPins())
        for context, replica in pins:
            held.pin(context, replica)
        index = self._index(deployment, max_blocks)
        for keys, replica in prompts:
            index.insert_keys(keys, replica)
        for gone in [r for r, t in self.writers.items() if now - t > ACTIVE_S]:
            del self.writers[gone]
        return len(self.writers) - 1

    def where(self, deployment: str, context: str) -> str | None:
        held = self.pins.get(deployment)
        return None if held is None else held.holder.get(context)

    def claim(self, deployment: str, context: str, replica: str, live: Sequence[str]) -> str:
        """The replica `context` is pinned to if it is live, else `replica`, pinned now."""
        held = self.pins.setdefault(deployment, ContextPins())
        home = held.holder.get(context)
        if home not in live:
            home = replica
            held.pin(context, home)
        return home

    def park(
        self,
        deployment: str,
        context: str,
        data: bytes,
        to: str | None = None,
        source: str | None = None,
    ) -> bool:
        """A context leaving its replica `source` (slot-file bytes), to be taken by the
        replica its next call reaches. Put in the object store from here, so that this
        actor owns it and it outlives the replica. Its pin goes to `to` (an operator's
        move), or goes (a drained replica's): the next call goes where the usual choice
        sends it. False, and nothing parked, if the context was made again on another
        replica since it left `source`: that copy is the one its calls now use."""
        now = time.monotonic()
        self._expire(now)
        held = self.pins.setdefault(deployment, ContextPins())
        home = held.holder.get(context)
        if source is not None and home is not None and home != source:
            return False
        self.parked[(deployment, context)] = ([ray.put(data)], now, 0.0)
        if to is None:
            held.unpin(context)
        else:
            held.pin(context, to)
        return True

    def _expire(self, now: float) -> None:
        for key in [k for k, (_, at, _) in self.parked.items() if now - at > PARKED_S]:
            del self.parked[key]

    def forget(self, deployment: str, context: str, replica: str) -> None:
        """`replica` freed `context`: no longer counted as held there."""
        held = self.pins.get(deployment)
        if held is not None and held.holder.get(context) == replica:
            held.unpin(context)

    def plan(self, deployment: str, live: Sequence[str]) -> list[tuple[str, str, str]]:
        """Moves (context, from, to) that even out how many contexts the `live` replicas
        hold, to within one: the least recently used of the fullest go to the emptiest."""
        held = self.pins.get(deployment, ContextPins())
        order = {context: i for i, context in enumerate(held.holder)}
        counts = {r: sorted(held.held.get(r, ()), key=order.__getitem__) for r in live}
        moves: list[tuple[str, str, str]] = []
        while counts:
            most = max(counts, key=lambda r: len(counts[r]))
            least = min(counts, key=lambda r: len(counts[r]))
            if len(counts[most]) - len(counts[least]) <= 1:
                return moves
            context = counts[most].pop(0)
            counts[least].append(context)
            moves.append((context, most, least))
        return moves

    def unpark(self, deployment: str, context: str, replica: str) -> list | None:
        """The parked context, lent to `replica` (pinned there) until it says the restore
        went (`taken`) or did not (`returned`), or LENT_S pass; None if none is parked
        (or it is lent to another replica now)."""
        now = time.monotonic()
        self._expire(now)
        parked = self.parked.get((deployment, context))
        if parked is None or now - parked[2] < LENT_S:
            return None
        self.parked[(deployment, context)] = (parked[0], parked[1], now)
        self.pins.setdefault(deployment, ContextPins()).pin(context, replica)
        return parked[0]

    def taken(self, deployment: str, context: str) -> None:
        """The lent context is restored (or not this model's): no longer parked."""
        self.parked.pop((deployment, context), None)

    def returned(self, deployment: str, context: str) -> None:
        """The lent context's restore failed: parked again for the next call."""
        parked = self.parked.get((deployment, context))
        if parked is not None:
            self.parked[(deployment, context)] = (parked[0], parked[1], 0.0)

    def match(self, deployment: str, keys: Sequence[int], live: Sequence[str]) -> tuple:
        index = self.prefixes.get(deployment)
        return ([], 0) if index is None else index.match_keys(keys, live)


def start_routing_state(app: str) -> Any:
    """The app's RoutingState actor: started, or the one already there."""
    return (
        ray.remote(RoutingState)
        .options(
            name=actor_name(app),
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
        )
        .remote()
    )


class SharedRouting:
    """One router's link to its app's RoutingState: the calls above, bounded in time,
    with the prefix keys batched. Every failure reads as "unknown"."""

    def __init__(self, app: str, deployment: str, max_blocks: int) -> None:
        self.name, self.deployment, self.max_blocks = actor_name(app), deployment, max_blocks
        self.router = uuid.uuid4().hex
        self.others = True  # until the actor says otherwise: there may be other ingresses
        self._actor: Any = None
        self._looked_at = -LOOKUP_EVERY_S
        self._prompts: list[tuple[list[int], str]] = []
        self._flush_due = False

    def handle(self) -> Any:
        if self._actor is None and time.monotonic() - self._looked_at >= LOOKUP_EVERY_S:
            self._looked_at = time.monotonic()
            try:
                if not ray.is_initialized():  # a router outside Ray (tests): never start one
                    raise ValueError("no Ray")
                self._actor = ray.get_actor(self.name, namespace=NAMESPACE)
            except Exception:  # noqa: BLE001 (not started: no registry, or not yet)
                self.others = False
        return self._actor

    async def _call(self, method: str, *args: Any) -> Any:
        actor = self.handle()
        if actor is None:
            return None
        try:
            return await asyncio.wait_for(getattr(actor, method).remote(*args), TIMEOUT_S)
        except TimeoutError:  # busy (a big context being parked): unknown this time
            logger.debug("routing state %s timed out", method)
            return None
        except Exception as exc:  # gone or restarting: unknown; look it up again
            logger.debug("routing state %s failed: %r", method, exc)
            self._actor = None
            return None

    async def where(self, context: str) -> str | None:
        return await self._call("where", self.deployment, context)

    async def claim(self, context: str, replica: str, live: Sequence[str]) -> str:
        home = await self._call("claim", self.deployment, context, replica, list(live))
        return replica if home is None else home

    async def plan(self, live: Sequence[str]) -> list[tuple[str, str, str]]:
        return await self._call("plan", self.deployment, list(live)) or []

    async def match(self, keys: Sequence[int], live: Sequence[str]) -> tuple[list[str], int]:
        found = await self._call("match", self.deployment, list(keys), list(live))
        return ([], 0) if found is None else found

    async def park(
        self, context: str, data: bytes, to: str | None = None, source: str | None = None
    ) -> bool:
        """Park a context's slot-file bytes with the shared actor, pinned to `to` if given.
        False: there is none, it did not take them in time, or the context was made again
        elsewhere since it left `source` (this copy is not needed)."""
        actor = self.handle()
        if actor is None:
            return False
        try:
            ref = actor.park.remote(self.deployment, context, data, to, source)
            return bool(await asyncio.wait_for(ref, PARK_S))
        except Exception as exc:  # noqa: BLE001
            logger.warning("context %s could not be parked: %r", context, exc)
            return False

    async def unpark(self, context: str, replica: str) -> bytes | None:
        """A parked context's slot-file bytes, lent to `replica` (see RoutingState.unpark:
        say `taken` or `returned` after); None if none."""
        blob = await self._call("unpark", self.deployment, context, replica)
        if not blob:
            return None
        try:
            return await blob[0]
        except BaseException:
            self.returned(context)
            raise

    def taken(self, context: str) -> None:
        self._tell("taken", context)

    def returned(self, context: str) -> None:
        self._tell("returned", context)

    def _tell(self, method: str, *args: Any) -> None:
        """A call whose answer is not awaited."""
        actor = self.handle()
        if actor is not None:
            getattr(actor, method).remote(self.deployment, *args)

    def pinned(self, context: str, replica: str) -> None:
        """A context was created on `replica`: sent at once."""
        self._send([(context, replica)], [])

    def freed(self, context: str, replica: str) -> None:
        """`replica` freed a context: sent at once, answer not awaited."""
        self._tell("forget", context, replica)

    def sent(self, keys: list[int], replica: str) -> None:
        """A prompt with these block keys went to `replica`: sent within FLUSH_S."""
        if not keys:
            return
        self._prompts.append((keys, replica))
        if self._flush_due:
            return
        self._flush_due = True
        try:
            asyncio.get_running_loop().call_later(FLUSH_S, self._flush)
        except RuntimeError:  # no loop in this thread: now
            self._flush()

    def _flush(self) -> None:
        self._flush_due = False
        prompts, self._prompts = self._prompts, []
        self._send([], prompts)

    def _send(self, pins: list[tuple[str, str]], prompts: list[tuple[list[int], str]]) -> None:
        actor = self.handle()
        if actor is None:
            return
        ref = actor.push.remote(self.router, self.deployment, pins, prompts, self.max_blocks)
        ref.future().add_done_callback(self._heard)

    def _heard(self, future: Any) -> None:
        try:
            self.others = future.result() > 0
        except Exception:  # noqa: BLE001 (the actor went: look it up again)
            self._actor = None
