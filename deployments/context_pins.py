"""ContextPins: which replica holds each context. Every router keeps one (its local view)
and the RoutingState every ingress shares keeps one per deployment (routing_state.py)."""

from collections import OrderedDict
from collections.abc import Collection

MAX_PINS = 100_000  # contexts remembered (~150 B each)


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

    def retain(self, replicas: Collection[str]) -> None:
        """Drop the pins of every replica not in `replicas` (the live ones)."""
        for gone in [r for r in self.held if r not in replicas]:
            self.drop_replica(gone)
