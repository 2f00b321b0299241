"""RequestGuard: the ingress's outer ASGI layer (inside CORS): the Host, keys, body size,
client disconnects and a deadline, the same for every route and whatever the client asks.

- **Host.** A Host header that is neither an IP address nor one of `allowed_hosts` gets
  421 (a WebSocket is closed unopened): a DNS-rebinding page never reaches a route.
- **Keys.** With `api_keys` set, every path but `/health` needs a bearer key (an admin key
  will do). `/health` answers anyone; `scope["state"]["authenticated"]` tells it whether
  to add slot detail. `scope["state"]["caller"]` says who it is (deployments/http/caller.py).
- **Body size.** The body is read here, before any route, and refused with 413 once past
  `max_request_bytes`, whether the client declared a Content-Length or streamed it in
  chunks, and with 408 if it has not all arrived after `request_body_timeout_s`. The
  route then reads the buffered body. An upload (`POST /v1/files`) is bounded instead by
  `files.max_file_bytes` and a little room for its multipart framing, and has
  `request_body_timeout_s` plus a second per MiB over `max_request_bytes` to arrive; the
  route counts the file's own bytes.
- **Disconnects.** When the client goes, the route's task is cancelled, so its generation
  is aborted at every hop. Serve's proxy does that, unless the client sent
  `x-request-disconnect-disabled: ?1`; then this layer watches the client's receive
  channel itself (only then: each watch costs a call to the proxy).
- **Drain.** Once the operator drains the app (`Admission.draining`), every new request gets 503;
  the open ones go on, and `Admission.open` counts them so the drain knows when they are done.
- **WebSockets** need the key too: in the Authorization header, or, since a browser
  cannot set headers on a WebSocket, as a subprotocol `shoal.key.<base64url of the key>`
  beside `shoal.events`. Never in the URL, which proxies and access logs keep.
- **Deadline.** A request still running after `request_timeout_s` is cancelled: a 408 if
  nothing was sent yet, else its body is ended. A client's `x-request-timeout-seconds`
  can shorten Serve's own timeout but never lift this one.
"""

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from app.protocol.errors import RemoteError
from deployments.config import AppConfig
from deployments.http.caller import Caller, is_loopback, key_id
from deployments.http.errors import dialect_body, relative_path
from deployments.http.hosts import host_allowed

logger = logging.getLogger("ray.serve")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
# (scope, status, seconds) after each request, for metrics and the access log.
Observer = Callable[[Scope, int, float], None]

PUBLIC_PATHS = ("/health",)
KEY_SUBPROTOCOL = "shoal.key."
DISCONNECT_OPT_OUT = b"x-request-disconnect-disabled"
UPLOAD_PATH = "/v1/files"
UPLOAD_FRAMING = 64 * 1024  # multipart boundaries, part headers, `purpose`, `expires_after`
UPLOAD_RATE = 1024 * 1024  # bytes a second an upload must at least keep up


@dataclass
class Admission:
    """Whether the ingress takes new requests, and how many it has open (HTTP only)."""

    draining: bool = False
    open: int = 0


def error_body(path: str, status: int, message: str, code: str) -> bytes:
    refusal = RemoteError(status, "", message, None)
    refusal.code = code
    return json.dumps(dialect_body(path, refusal)).encode()


class RequestGuard:
    def __init__(
        self,
        app: Any,
        config: AppConfig,
        observe: Observer | None = None,
        admission: "Admission | None" = None,
    ) -> None:
        self.app = app
        self.admission = admission or Admission()
        self.keys = [k.encode() for k in config.api_keys]
        self.admin_keys = [k.encode() for k in config.admin_api_keys]
        self.allowed_hosts = list(config.allowed_hosts)
        self.loopback_operator = config.loopback_operator
        self.max_bytes = config.max_request_bytes
        files = config.files
        self.max_upload_bytes = files.max_file_bytes + UPLOAD_FRAMING if files.enabled else None
        self.timeout_s = config.request_timeout_s
        self.body_timeout_s = config.request_body_timeout_s
        self.observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        foreign = not host_allowed(_header(scope, b"host"), self.allowed_hosts)
        if foreign:
            logger.warning("refused Host %r (not in allowed_hosts)", _header(scope, b"host"))
        caller = self._caller(scope)
        state = scope.setdefault("state", {})
        state["caller"], state["authenticated"] = caller, caller is not None
        if scope["type"] == "websocket":
            if foreign or caller is None or self.admission.draining:
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        if foreign:
            path = relative_path(scope)
            message = "this server does not answer that Host (allowed_hosts)"
            await _reply(send, 421, error_body(path, 421, message, "host_not_allowed"))
            return
        if self.admission.draining:
            path = relative_path(scope)
            message = "the server is shutting down"
            await _reply(send, 503, error_body(path, 503, message, "shutting_down"))
            return
        started = time.perf_counter()
        self.admission.open += 1
        status = {"code": 0}

        async def observed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, observed_send)
        except Exception:
            status["code"] = status["code"] or 500  # Starlette's outer layer answers it
            raise
        finally:
            self.admission.open -= 1
            if self.observe is not None:
                with contextlib.suppress(Exception):
                    self.observe(scope, status["code"], time.perf_counter() - started)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = relative_path(scope)
        if not scope["state"]["authenticated"] and path not in PUBLIC_PATHS:
            await _reply(
                send, 401, error_body(path, 401, "Invalid or missing API key", "invalid_api_key")
            )
            return
        limit = self._body_limit(scope, path)
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._too_large(send, path, limit)
            return
        # An upload larger than any other body gets time in proportion: at least
        # UPLOAD_RATE on top of the usual allowance (64 MiB: 94 s, not 30).
        allowed_s = self.body_timeout_s + max(0, limit - self.max_bytes) / UPLOAD_RATE
        try:
            async with asyncio.timeout(allowed_s):
                body = await _read_body(receive, limit)
        except _ClientGone:
            return
        except TimeoutError:  # a client trickling its body would hold a slot for ever
            message = f"the request body did not arrive within {allowed_s:g} s"
            await _reply(send, 408, error_body(path, 408, message, "request_timeout"))
            return
        if body is None:
            await self._too_large(send, path, limit)
            return
        await self._run(_as_json(scope, body), receive, send, body, path)

    async def _run(
        self, scope: Scope, receive: Receive, send: Send, body: bytes, path: str
    ) -> None:
        gone = asyncio.Event()
        sent = {"body": False, "started": False, "ended": False}

        async def app_receive() -> Message:
            if not sent["body"]:
                sent["body"] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def app_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                sent["ended"] = True
            await send(message)

        async def watch() -> None:
            try:
                while (await receive())["type"] != "http.disconnect":
                    pass
            except Exception as exc:  # the channel broke: treat the client as gone
                logger.warning("%s: receive failed: %r", path, exc)
            gone.set()

        app = asyncio.ensure_future(self.app(scope, app_receive, app_send))
        tasks = {app}
        watcher = None
        if _header(scope, DISCONNECT_OPT_OUT) == "?1":  # Serve's proxy will not watch
            watcher = asyncio.ensure_future(watch())
            tasks.add(watcher)
        try:
            done, _ = await asyncio.wait(
                tasks, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if app in done:
                app.result()
                return
            timed_out = watcher is None or watcher not in done
            app.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await app
            if not timed_out:
                return  # the client is gone: nothing to send
            logger.warning("%s: cancelled after request_timeout_s=%s", path, self.timeout_s)
            if not sent["started"]:
                message = (
                    f"the request took longer than this server's limit of {self.timeout_s:g} s"
                )
                await _reply(send, 408, error_body(path, 408, message, "request_timeout"))
            elif not sent["ended"]:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            for task in tasks:
                task.cancel()

    def _caller(self, scope: Scope) -> Caller | None:
        """Who sent this, or None when it needs a key and has none that is valid."""
        token = _token(scope)
        admin = any(hmac.compare_digest(token, k) for k in self.admin_keys)
        valid = admin or any(hmac.compare_digest(token, k) for k in self.keys)
        if self.keys and not valid:
            return None
        local = self.loopback_operator and not self.admin_keys and is_loopback(scope)
        keyed = bool(self.keys or self.admin_keys)
        return Caller(key_id(token) if valid else None, admin, admin or local, keyed)

    def _body_limit(self, scope: Scope, path: str) -> int:
        upload = scope.get("method") == "POST" and path.rstrip("/") == UPLOAD_PATH
        if upload and self.max_upload_bytes is not None:
            return self.max_upload_bytes
        return self.max_bytes

    async def _too_large(self, send: Send, path: str, limit: int) -> None:
        message = f"request body over {limit} bytes"
        await _reply(send, 413, error_body(path, 413, message, "request_too_large"))


def _as_json(scope: Scope, body: bytes) -> Scope:
    """The scope, with a JSON content type when the body is JSON but was sent as something
    else: `curl -d` says form-urlencoded, and Ollama's and llama.cpp's servers read a
    JSON body whatever the header says. Multipart (file uploads) is left as it is, and so
    is a body a browser sent from another site's page: text/plain and form posts cross
    sites without a CORS preflight, and read as JSON they would let any page a user
    visits drive this server. (In place: the access log reads the matched route from
    this same scope.)"""
    declared = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
    json_like = body.lstrip()[:1] in (b"{", b"[")
    if (
        json_like
        and declared != "application/json"
        and not declared.startswith("multipart/")
        and not _from_another_site(scope)
    ):
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-type"]
        scope["headers"] = [*headers, (b"content-type", b"application/json")]
    return scope


def _from_another_site(scope: Scope) -> bool:
    """Whether a browser sent this from another site's page (`Sec-Fetch-Site`, which
    current browsers send, or an `Origin` that is not this host). curl and SDKs send
    neither."""
    if _header(scope, b"sec-fetch-site") in ("cross-site", "same-site"):
        return True
    origin = _header(scope, b"origin")
    return bool(origin) and urlsplit(origin).netloc != _header(scope, b"host")


def _token(scope: Scope) -> bytes:
    """The key a request presents: a bearer token, Anthropic's x-api-key, or a
    WebSocket's key subprotocol."""
    auth = (_header(scope, b"authorization") or "").strip()
    token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    token = token or (_header(scope, b"x-api-key") or "").strip()
    if not token and scope["type"] == "websocket":
        for protocol in scope.get("subprotocols", ()):
            if protocol.startswith(KEY_SUBPROTOCOL):
                encoded = protocol[len(KEY_SUBPROTOCOL) :]
                with contextlib.suppress(ValueError):
                    padding = "=" * (-len(encoded) % 4)
                    token = base64.urlsafe_b64decode(encoded + padding).decode()
    return token.encode()


class _ClientGone(Exception):
    """The client left before it had sent its whole body."""


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes `limit` bytes (the rest is never read)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _reply(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
