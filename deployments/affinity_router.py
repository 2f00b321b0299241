"""ContextAffinityRouter: requests that name a context reach the replica that holds it.

A context (Parrot's, or a llama.cpp slot) lives in one replica's KV cache. Serve routes
each handle call through this router (the deployment's `request_router_class`): the
first request that creates a context goes wherever Serve's power-of-two choices sends it
(a child context goes where its parent is), and the router remembers that replica;
every later call that names the context (Generate, Fill, free, slot save/restore) is
sent there. If that replica is gone, its contexts went with it: the call falls back to
the usual choice and gets the engine's 404.

The map lives in the ingress process, shared by every handle of the deployment there;
with several ingress replicas each learns its own (contexts then need a sticky client).
"""

from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

# (app, deployment, context id) -> replica unique id, for this process.
_HOLDERS: dict[tuple[str, str, str], str] = {}


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


class ContextAffinityRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        context, parent = _contexts(pending_request)
        app, deployment = self._deployment_id.app_name, self._deployment_id.name
        for key in (context, parent):
            holder = _HOLDERS.get((app, deployment, key)) if key else None
            if holder is not None:
                for replica in candidate_replicas:
                    if replica.replica_id.unique_id == holder:
                        return [[replica]]
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        context, _ = _contexts(pending_request)
        if context is None:
            return
        key = (self._deployment_id.app_name, self._deployment_id.name, context)
        method, args = pending_request.metadata.call_method, pending_request.args
        if method == "free_context":
            _HOLDERS.pop(key, None)
        elif method == "generate" or (method == "slot_action" and args[0] == "restore"):
            # Only calls that can create the context pin it; a lookup must not.
            _HOLDERS.setdefault(key, replica_id.unique_id)
