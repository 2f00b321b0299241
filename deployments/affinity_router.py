"""AffinityRouter: send a request to the replica whose KV cache already holds its start.

Serve routes each ModelServer handle call through this router (the deployment's
`request_router_class`), in the ingress process. It reads one typed object from a call,
whatever the method: its `ContextOp` (`app.protocol.messages.context_op`), or for a
generation that names no context, its `EngineRequest`'s prompt. Method names and argument
positions mean nothing here.

- A call that names a context (Parrot's Fill/Generate/free, a llama.cpp slot) must reach
  the one replica that holds it. A call whose action may create the context
  (`ContextAction.creates`) goes where the usual choice sends it (a child goes where its
  parent is) and pins it there, before it is sent, so that a concurrent call for the same
  new context follows it. The other actions only follow a pin: if that replica is gone,
  its contexts went with it, and the call falls back to the usual choice and gets the
  engine's 404. A pinned call waits (with backoff) for its replica alone.
- A generation that runs a LoRA adapter goes to a replica holding it, as Serve's
  multiplexing routes (`multiplexed_model_id`, replica_adapters.py).
- Any other generation prefers the replicas that were sent the longest prefix of its
  prompt (a shared system prompt, the earlier turns of a chat), as remembered by a
  PrefixIndex, unless they are busier than the least loaded replica by more than
  `max_imbalance` ongoing requests, or full. The preference is a first rank; the usual
  choice is the next.

The usual choice is Serve's power of two choices, built here on the public router API
(`ray.serve.request_router`): two random replicas among those the locality policy offers
(`apply_locality_routing`: this node, then this zone, then all, one step per attempt);
Serve then sends to the one with the shorter queue. The decisions themselves are the
pure functions below, over replica ids and queue lengths.

The maps live in this process, shared by every router of the deployment here, and are
the cache of the app's RoutingState (routing_state.py), which every ingress replica's
routers write to and read what they do not know from: a context created through one
ingress is found through another, and after an ingress restart.

A replica that leaves the live set without dying is draining: it parks its contexts
once its last calls end (context_moves.py). A call for one of them waits for that (while
the replica lives, at most `move_wait_s`, its graceful shutdown's budget) rather than
reaching another replica before the context does.

The router hands each chosen replica to the request it was chosen for (the base class's
default): Serve's FIFOMixin would give it to the oldest waiting request, which for a
pinned context would be the wrong replica.
"""

import asyncio
import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from app.protocol.messages import ContextOp, EngineRequest, context_op
from deployments.config import RoutingConfig
from deployments.context_pins import ContextPins
from deployments.prefix_index import PrefixIndex
from deployments.routing_state import SharedRouting

T = TypeVar("T")


# ---- The decisions, over replica ids and queue lengths (no Serve objects) ----


def context_home(
    op: ContextOp, pins: ContextPins, live: Collection[str], new_home: Callable[[], str]
) -> str | None:
    """The replica a call naming `op`'s context must go to: the live one it is pinned to,
    else (a child) its parent's. If neither and the call may create the context, the one
    `new_home` picks. A call that may create the context pins it there now, before it is
    sent. None: the call can go anywhere (its holder is gone; it will get a 404)."""
    home = pins.holder.get(op.context_id)
    if home not in live and op.parent_context_id is not None:
        home = pins.holder.get(op.parent_context_id)
    if home not in live:
        if not op.action.creates:
            return None
        home = new_home()
    if op.action.creates:
        pins.pin(op.context_id, home)
    return home


def two_choices(candidates: Sequence[T], rng: random.Random | None = None) -> list[T]:
    """Two distinct candidates in random order (all of them if fewer): the sample of the
    power of two choices."""
    return (rng or random).sample(candidates, min(2, len(candidates)))


def least_loaded(replicas: Sequence[str], load: Mapping[str, int]) -> str:
    """The replica with the shortest queue; the first of equals."""
    return min(replicas, key=load.__getitem__)


def balanced_holders(
    holders: Sequence[str], load: Mapping[str, int], max_imbalance: int
) -> list[str]:
    """The prefix holders no busier than the least loaded replica (of all in `load`) by
    more than `max_imbalance` ongoing requests."""
    least = min(load.values())
    return [h for h in holders if load[h] - least <= max_imbalance]


def prompt_of(args: Sequence[Any]) -> list[int] | None:
    """The prompt of a generation that names no context: what prefix affinity reads."""
    for arg in args:
        if isinstance(arg, EngineRequest):
            return arg.prompt_token_ids if arg.context is None else None
    return None


def call_args(pending: PendingRequest | None) -> tuple[Any, ...]:
    """Every argument of a call, positional or named: the typed objects are found by type."""
    if pending is None:
        return ()
    return (*pending.args, *pending.kwargs.values())


# ---- The router: Serve's hooks, wired to the decisions above ----

# (app, deployment) -> where prompts were sent, which replica holds each context, and the
# link to what every ingress knows.
_SHARED: dict[tuple[str, str], tuple[PrefixIndex, ContextPins, SharedRouting]] = {}


class AffinityRouter(MultiplexMixin, LocalityMixin, RequestRouter):
    def __init__(self, *args: Any, deployment_id: Any, **kwargs: Any) -> None:
        super().__init__(*args, deployment_id=deployment_id, **kwargs)
        # Serve passes its DeploymentID (a documented constructor argument): the key under
        # which this process's routers for one deployment share their maps.
        self.deployment_key = (deployment_id.app_name, deployment_id.name)

    def initialize_state(
        self,
        routing: dict[str, Any] | None = None,
        block_size: int = 16,
        move_wait_s: float = 30.0,
        **kwargs: Any,
    ) -> None:
        super().initialize_state(**kwargs)
        self.routing = RoutingConfig.model_validate(routing or {})
        self.move_wait_s = move_wait_s
        self.live: dict[str, RunningReplica] = {}
        self.departed: dict[str, tuple[RunningReplica, float]] = {}  # draining, since when
        if self.deployment_key not in _SHARED:
            _SHARED[self.deployment_key] = (
                PrefixIndex(
                    block_size, self.routing.max_prefix_tokens, self.routing.max_indexed_blocks
                ),
                ContextPins(),
                SharedRouting(*self.deployment_key, self.routing.max_indexed_blocks),
            )
        self.prefixes, self.pins, self.shared = _SHARED[self.deployment_key]

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        args = call_args(pending_request)
        op = context_op(args)
        if op is not None and pending_request is not None:
            by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
            known = await self._learn_pins(op, by_id)
            home = context_home(
                op,
                self.pins,
                by_id,
                lambda: self._new_home(candidate_replicas, pending_request),
            )
            if home is not None and op.action.creates and not known and self.shared.others:
                # Another ingress may be creating it too: the first claim wins.
                claimed = await self.shared.claim(op.context_id, home, list(by_id))
                if claimed in by_id and claimed != home:
                    home = claimed
                    self.pins.pin(op.context_id, home)
            if home is not None:
                # Only this replica will do: if it is full, wait (with backoff) for it.
                pending_request.routing_context.should_backoff = True
                return [[by_id[home]]]
        if pending_request is not None and pending_request.metadata.multiplexed_model_id:
            return [self._adapter_holders(candidate_replicas, pending_request)]
        usual = self._power_of_two(candidate_replicas, pending_request)
        ranks = [usual] if usual else []
        preferred = await self._prefix_holders(candidate_replicas, prompt_of(args))
        return [preferred, *ranks] if preferred else ranks

    async def _learn_pins(self, op: ContextOp, live: Collection[str]) -> bool:
        """A context (or the parent of a new one) with no live pin here may have been made
        through another ingress, or before this one restarted: ask what every ingress
        knows. True: the context itself has a live pin now.
        With other ingresses about, what they all know comes first even for a pinned
        context: an operator may have moved it (context_rebalance.py)."""
        for context in (op.context_id, op.parent_context_id):
            if context is None:
                continue
            home = self.pins.holder.get(context)
            if home in live and not self.shared.others:
                return context == op.context_id
            known = await self.shared.where(context)
            if known in self.departed:
                known = await self._await_move(context, known)
            if known in live and known != home:
                self.pins.pin(context, known)
                home = known
            if home in live:
                return context == op.context_id
        return False

    async def _await_move(self, context: str, replica: str) -> str | None:
        """Where `context` is pinned once its draining `replica` has parked it (the pin
        changes or goes), it died, or `move_wait_s` since it left has passed."""
        gone, since = self.departed[replica]
        pause = 0.02
        while time.monotonic() - since < self.move_wait_s:
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.5)
            known = await self.shared.where(context)
            if known != replica:
                return known
            try:
                await asyncio.wait_for(gone.get_queue_len(deadline_s=1.0), 1.0)
            except TimeoutError:
                pass
            except Exception:  # noqa: BLE001 (its actor died: it parks nothing more)
                self.departed.pop(replica, None)
                return await self.shared.where(context)
        return replica

    def _power_of_two(
        self, candidates: list[RunningReplica], pending: PendingRequest | None
    ) -> list[RunningReplica]:
        """Two random replicas among those the locality policy offers this attempt; Serve
        sends to the one with the shorter queue (probing it if not cached)."""
        local = self.apply_locality_routing(pending)
        return two_choices([r for r in candidates if r.replica_id in local])

    def _adapter_holders(
        self, candidates: list[RunningReplica], pending: PendingRequest
    ) -> list[RunningReplica]:
        """A LoRA adapter's request: two random replicas among those holding its adapter,
        or (none free for a while) those holding the fewest, then any (Serve's
        multiplexing policy, one step per attempt). Its prefix cache is the adapter's
        own, so where the base's prompts went means nothing to it."""
        allowed = self.apply_multiplex_routing(pending)
        return two_choices([r for r in candidates if r.replica_id in allowed])

    def _new_home(self, candidates: list[RunningReplica], pending: PendingRequest) -> str:
        """Where a new context goes: the power of two choices, decided here (it is pinned
        before Serve sees the queues), preferring a replica that is not full."""
        pair = self._power_of_two(candidates, pending) or candidates
        # Both full: any replica with room rather than waiting (pinned) for a full one.
        pool = (
            self.select_available_replicas(pair)
            or self.select_available_replicas(candidates)
            or pair
        )
        return least_loaded([r.replica_id.unique_id for r in pool], self._loads(pool))

    async def _prefix_holders(
        self, candidates: list[RunningReplica], prompt: list[int] | None
    ) -> list[RunningReplica]:
        """The replicas holding the prompt's longest known prefix (here, else, if other
        ingresses write, in what they all know), if that prefix is worth it and they are
        neither full nor much busier than the least loaded replica."""
        if not prompt or not self.routing.prefix_affinity or len(candidates) < 2:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidates}
        keys = self.prefixes.keys(prompt)
        holders, depth = self.prefixes.match_keys(keys, by_id)
        enough = -(-self.routing.min_match_tokens // self.prefixes.block_size)
        if depth < enough and self.shared.others:
            holders, depth = await self.shared.match(keys, list(by_id))
        if depth < enough:
            return []
        kept = balanced_holders(holders, self._loads(candidates), self.routing.max_imbalance)
        return self.select_available_replicas([by_id[h] for h in kept if h in by_id])

    def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Ongoing requests per replica as last seen (unknown: 0, as Serve counts it)."""
        cache = self.replica_queue_len_cache
        return {r.replica_id.unique_id: cache.get(r.replica_id) or 0 for r in replicas}

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        args = call_args(pending_request)
        prompt = prompt_of(args)
        # An adapter's KV is its own: its prompt is no prefix of the base model's.
        adapter = pending_request.metadata.multiplexed_model_id
        if prompt and self.routing.prefix_affinity and not adapter:
            keys = self.prefixes.keys(prompt)
            self.prefixes.insert_keys(keys, replica_id.unique_id)
            self.shared.sent(keys, replica_id.unique_id)
        op = context_op(args)
        if op is None:
            return
        if op.action.creates:
            self.pins.pin(op.context_id, replica_id.unique_id)  # where it really went
            self.shared.pinned(op.context_id, replica_id.unique_id)
        else:
            self.pins.touch(op.context_id)

    # A gone replica's contexts went with it. Its prefix entries are left to age out of
    # the index (LRU): `match` only ever considers live replicas.
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        now, live = time.monotonic(), {r.replica_id.unique_id: r for r in replicas}
        for replica_id, replica in self.live.items():
            if replica_id not in live:
                self.departed[replica_id] = (replica, now)
        for old in [r for r, (_, t) in self.departed.items() if now - t > self.move_wait_s]:
            del self.departed[old]
        self.live = live
        self.pins.retain(live)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.pins.drop_replica(replica_id.unique_id)
        self.departed.pop(replica_id.unique_id, None)


def repin(app: str, deployment: str, context: str, replica: str) -> None:
    """An operator moved `context` to `replica`: this process's routers follow at once
    (others learn it from the RoutingState)."""
    shared = _SHARED.get((app, deployment))
    if shared is not None:
        shared[1].pin(context, replica)
