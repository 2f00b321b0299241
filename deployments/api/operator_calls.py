"""Calls on the Operator deployment from any dialect's routes (the operator API's, and
Ollama's pull and delete, which manage models through it), and the guard of those that
change state (some on a GET)."""

from typing import Any
from urllib.parse import urlsplit

from fastapi import Depends, Request

from app.protocol.errors import NotFoundError, PermissionDeniedError
from deployments.http.caller import caller_of
from deployments.ingress import Ingress, unwrap


def cross_site(headers: Any, allowed_origins: list[str]) -> bool:
    """Whether a browser sent this from another site's page. These routes change state on
    a GET (the spec's choice), and a page elsewhere could make a visitor's browser call
    them: `Sec-Fetch-Site` (every current browser sends it) or `Origin` tells."""
    origin = headers.get("origin")
    if origin and origin in allowed_origins:
        return False
    if headers.get("sec-fetch-site") in ("cross-site", "same-site"):
        return True
    return bool(origin) and urlsplit(origin).netloc != headers.get("host")


def operator_action(request: Request) -> None:
    """The guard of every call that changes the operator's state: never from another
    site's page, and only from an admin key, or, with no admin keys set, from a client
    on this machine (deployments/http/caller.py)."""
    if cross_site(request.headers, request.app.state.ingress.config.cors_origins):
        raise PermissionDeniedError("refused: a request from another site's page")
    if not caller_of(request).operator:
        raise PermissionDeniedError(
            "refused: operator actions need an admin key (admin_api_keys), or a client on "
            "the server's own machine when none is set"
        )


OperatorAction = Depends(operator_action)


async def operator_call(ingress: Ingress, method: str, *args: Any) -> Any:
    """A call on the Operator deployment; its error is raised as itself."""
    if ingress.operator is None:
        raise NotFoundError("the operator API is turned off on this server")
    try:
        return await getattr(ingress.operator, method).remote(*args)
    except Exception as exc:
        raise unwrap(exc) from None


async def manage(ingress: Ingress, method: str, *args: Any) -> Any:
    return await operator_call(ingress, "call", method, *args)
