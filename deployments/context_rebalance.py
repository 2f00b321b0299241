"""Operators move contexts between live replicas: one context to a named replica, or a
model's contexts evened out over its replicas (after a scale-up, new replicas hold none:
every context made before stays where it was made).

A move is a call on the replica that holds the context (routed there by its pin, like any
context call): it saves the context, parks it with the app's RoutingState pinned to the
new replica, and frees it (context_moves.py). This ingress's routers follow the pin at
once; other ingresses read it from the RoutingState. The context's next call goes to the
new replica, which restores it first: the call computes only its new tokens.
"""

from typing import Any

from app.protocol.errors import InvalidRequestError, NotImplementedByServerError, ShoalError
from app.protocol.messages import ContextAction, ContextOp
from deployments.affinity_router import repin
from deployments.ingress import Ingress
from deployments.routing_state import SharedRouting


def _deployment(ingress: Ingress, model: str) -> tuple[str, str]:
    """The (app, deployment) of the model's replicas, as their routers name them."""
    ingress.model(model)  # 404 if not served
    handle = ingress.handle(model)
    try:
        return handle.app_name, handle.deployment_name
    except AttributeError:  # not a Serve handle (in-process tests): no routing state
        raise NotImplementedByServerError("contexts move only between Serve replicas") from None


async def live_replicas(ingress: Ingress, model: str) -> list[str]:
    return sorted(e["engine_id"] for e in await ingress.engines() if e["engine_name"] == model)


async def move(ingress: Ingress, model: str, context: str, to: str) -> dict[str, Any]:
    """Move one context to replica `to` (a live replica of the model)."""
    app, deployment = _deployment(ingress, model)
    if to not in await live_replicas(ingress, model):
        raise InvalidRequestError(f"{to!r} is not a live replica of {model!r}", "to")
    op = ContextOp(context, ContextAction.MOVE)
    tokens = await ingress.call(model, "move_context", op, to)
    repin(app, deployment, context, to)
    return {"context_id": context, "to": to, "tokens": tokens}


async def rebalance(ingress: Ingress, model: str) -> dict[str, Any]:
    """Even out the model's contexts over its live replicas (to within one each). A
    context that is busy (409) or gone (404) meanwhile stays as it is."""
    app, deployment = _deployment(ingress, model)
    live = await live_replicas(ingress, model)
    plan = await SharedRouting(app, deployment, max_blocks=0).plan(live)
    moved, skipped = [], []
    for context, source, to in plan:
        try:
            tokens = await ingress.call(
                model, "move_context", ContextOp(context, ContextAction.MOVE), to
            )
        except ShoalError as exc:
            skipped.append({"context_id": context, "from": source, "error": exc.message})
            continue
        repin(app, deployment, context, to)
        moved.append({"context_id": context, "from": source, "to": to, "tokens": tokens})
    return {"model": model, "replicas": live, "moved": moved, "skipped": skipped}
