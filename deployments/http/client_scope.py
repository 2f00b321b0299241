"""Which client a request comes from, for what its clients share by turns (the Tokenizer's
chat template workers, app/text/render_pool.py): the caller's key id when keys are
on (as the request guard found it), else the client's address.

`ClientScope`, an ASGI layer inside the request guard, sets it for each request; the
Ingress reads it (`current_client`) wherever a route calls it, in the tasks a route
starts too (a context variable), so no dialect has to pass it along.
"""

from contextvars import ContextVar
from typing import Any

from starlette.requests import HTTPConnection

from deployments.http.adapters import forget_named_adapter, restore_named_adapter
from deployments.http.caller import caller_of

_client: ContextVar[str] = ContextVar("shoal_client", default="")


def current_client() -> str:
    """The current request's client; "" outside a request."""
    return _client.get()


def client_of(connection: HTTPConnection) -> str:
    key_id = caller_of(connection).key_id  # type: ignore[arg-type]  (reads .state only)
    if key_id:
        return f"key:{key_id}"
    return f"address:{connection.client.host if connection.client else ''}"


class ClientScope:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        token = _client.set(client_of(HTTPConnection(scope)))
        adapter = forget_named_adapter()  # a connection's task may run several requests
        try:
            await self.app(scope, receive, send)
        finally:
            _client.reset(token)
            restore_named_adapter(adapter)
