"""AffinityRouter: send a request to the replica whose KV cache already holds its start.

Serve routes each ModelServer handle call through this router (the deployment's
`request_router_class`), in the ingress process:

- A call that names a context (Parrot's Fill/Generate/free, a llama.cpp slot) must reach
  the one replica that holds it. The call that creates a context goes where the usual
  choice sends it (a child goes where its parent is) and pins it there, before it is
  sent, so that a concurrent call for the same new context follows it; if that replica
  is gone, its contexts went with it: the call falls back and gets the engine's 404.
- Any other generate call prefers the replicas that were sent the longest prefix of its
  prompt (a shared system prompt, the earlier turns of a chat), as remembered by a
  PrefixIndex, unless they are busier than the least loaded replica by more than
  `max_imbalance` ongoing requests. The preference is a first rank: if those replicas
  are full, Serve's power-of-two choice among all replicas is the next.

The maps live in this process and are shared by every handle to the deployment here;
with several ingress replicas each learns its own (contexts then need a sticky client).

The router hands each chosen replica to the request it was chosen for: Serve's
power-of-two router (FIFOMixin) would give it to the oldest waiting request, which for
a pinned context would be the wrong replica.
"""

from collections import OrderedDict
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from deployments.config import RoutingConfig
from deployments.prefix_index import PrefixIndex

MAX_PINS = 100_000  # contexts remembered per ingress (~150 B each)


class ContextPins:
    """Which replica holds each context, and the reverse, so that a replica's pins go
    with it. At most `capacity` pins, least recently used dropped first. A pin outlives
    its context (freed, or dropped by the engine's limits): calls that name it go to
    that replica and get its 404, or create it there again. So a free does not unpin
    (it may also be refused while the context is busy)."""

    def __init__(self, capacity: int = MAX_PINS) -> None:
        self.capacity = capacity
        self.holder: OrderedDict[str, str] = OrderedDict()  # context id -> replica id
        self.held: dict[str, set[str]] = {}  # replica unique id -> context ids

    def pin(self, context: str, replica: str) -> None:
        self.unpin(context)
        self.holder[context] = replica
        self.held.setdefault(replica, set()).add(context)
        while len(self.holder) > self.capacity:
            self.unpin(next(iter(self.holder)))

    def touch(self, context: str) -> None:
        if context in self.holder:
            self.holder.move_to_end(context)

    def unpin(self, context: str) -> None:
        replica = self.holder.pop(context, None)
        if replica is not None:
            self.held.get(replica, set()).discard(context)

    def drop_replica(self, replica: str) -> None:
        for context in self.held.pop(replica, set()):
            self.holder.pop(context, None)


# (app, deployment) -> context pins / where prompts were sent, for this process.
_PINS: dict[tuple[str, str], ContextPins] = {}
# (app, deployment) -> where prompts were sent, for this process.
_PREFIXES: dict[tuple[str, str], PrefixIndex] = {}


def _contexts(pending: PendingRequest | None) -> tuple[str | None, str | None]:
    """(context id, parent context id) named by a ModelServer call."""
    if pending is None:
        return None, None
    method, args = pending.metadata.call_method, pending.args
    if method == "generate" and args and getattr(args[0], "context", None) is not None:
        op = args[0].context
        return op.context_id, op.parent_context_id
    if method in ("context_tokens", "free_context") and args:
        return str(args[0]), None
    if method == "slot_action" and len(args) >= 2:
        from deployments.model_server import slot_context

        return slot_context(int(args[1])), None
    return None, None


def _creates_context(pending: PendingRequest) -> bool:
    """Only calls that can create a context pin it; a lookup or a free must not."""
    method, args = pending.metadata.call_method, pending.args
    return method == "generate" or (method == "slot_action" and bool(args) and args[0] == "restore")


def _prompt(pending: PendingRequest | None) -> list[int] | None:
    """The prompt of a generate call that names no context."""
    if pending is None or pending.metadata.call_method != "generate" or not pending.args:
        return None
    request = pending.args[0]
    if getattr(request, "context", None) is not None:
        return None
    return getattr(request, "prompt_token_ids", None)


class AffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(
        self, routing: dict[str, Any] | None = None, block_size: int = 16, **kwargs: Any
    ) -> None:
        super().initialize_state(**kwargs)
        self.routing = RoutingConfig.model_validate(routing or {})
        key = (self._deployment_id.app_name, self._deployment_id.name)
        if key not in _PREFIXES:
            _PREFIXES[key] = PrefixIndex(
                block_size, self.routing.max_prefix_tokens, self.routing.max_indexed_blocks
            )
            _PINS[key] = ContextPins()
        self.prefixes, self.pins = _PREFIXES[key], _PINS[key]

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        context, parent = _contexts(pending_request)
        chosen = self._holder(candidate_replicas, context) or self._holder(
            candidate_replicas, parent
        )
        creates = context is not None and _creates_context(pending_request)
        if chosen is None and creates:
            ranks = await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self, candidate_replicas, pending_request
            )
            cache = self.replica_queue_len_cache
            pool = ranks[0] if ranks and ranks[0] else candidate_replicas
            chosen = min(pool, key=lambda r: cache.get(r.replica_id) or 0)
        if chosen is not None:
            if creates:
                # Pinned now, before the call is sent: a second call for the same new
                # context, routed meanwhile, must find the pin (else both replicas would
                # create it and one copy would leak).
                self.pins.pin(context, chosen.replica_id.unique_id)
            # Only this replica will do: if it is full, wait (with backoff) for it.
            pending_request.routing_context.should_backoff = True
            return [[chosen]]
        ranks = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas, pending_request
        )
        preferred = self._prefix_holders(candidate_replicas, _prompt(pending_request))
        return [preferred, *ranks] if preferred else ranks

    def _holder(
        self, candidates: list[RunningReplica], context: str | None
    ) -> RunningReplica | None:
        holder = self.pins.holder.get(context) if context else None
        if holder is None:
            return None
        return next((r for r in candidates if r.replica_id.unique_id == holder), None)

    def _prefix_holders(
        self, candidates: list[RunningReplica], prompt: list[int] | None
    ) -> list[RunningReplica]:
        """The replicas holding the prompt's longest known prefix, if that prefix is worth
        it and they are not much busier than the least loaded replica."""
        if not prompt or not self.routing.prefix_affinity or len(candidates) < 2:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidates}
        holders, matched = self.prefixes.match(prompt, by_id)
        if matched < self.routing.min_match_tokens:
            return []
        cache = self.replica_queue_len_cache
        load = {rid: cache.get(r.replica_id) or 0 for rid, r in by_id.items()}
        least = min(load.values())
        return [
            by_id[rid]
            for rid in holders
            if load[rid] - least <= self.routing.max_imbalance
            and load[rid] < by_id[rid].max_ongoing_requests
        ]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        prompt = _prompt(pending_request)
        if prompt and self.routing.prefix_affinity:
            self.prefixes.insert(prompt, replica_id.unique_id)
        context, _ = _contexts(pending_request)
        if context is None:
            return
        if _creates_context(pending_request):
            self.pins.pin(context, replica_id.unique_id)  # where it really went
        else:
            self.pins.touch(context)

    # A gone replica's contexts went with it. Its prefix entries are left to age out of
    # the index (LRU): `match` only ever considers live replicas.
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self._replica_id_set)
        super().update_replicas(replicas)
        for gone in before - set(self._replica_id_set):
            self.pins.drop_replica(gone.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.pins.drop_replica(replica_id.unique_id)
