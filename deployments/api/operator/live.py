"""The live WebSocket at /ws: every operator event (`metrics`, `status`,
`download_status`, `inference_status`) pushed to each connected client as JSON
{"event": ..., "data": ..., "seq": ..., "time": ...}, from whichever ingress replica it
is connected to. On connecting, a client first gets the current downloads and
inference items. A client may send {"type": "shutdown"} (or the text "shutdown") to
drain the server, as GET /api/shutdown does, if it may act as the operator (an admin key,
or a client on this machine when none is set); else it gets an `error` event.

A browser page passes its key as a subprotocol (`shoal.key.<base64url>`, beside
`shoal.events`, which the server picks): see deployments/http/guard.py.
"""

import asyncio
import contextlib
import json
import logging

from fastapi import APIRouter, FastAPI, WebSocket, WebSocketDisconnect

from deployments.api.operator_calls import cross_site, manage, operator_call
from deployments.http.caller import Caller
from deployments.http.host_detail import without_host_detail
from deployments.ingress import Ingress
from deployments.operator.follower import Broadcaster, Client, EventFollower

logger = logging.getLogger("ray.serve")
MAX_CLIENT_MESSAGE = 4096
SEND_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 30.0
SUBPROTOCOL = "shoal.events"
router = APIRouter()


def install(app: FastAPI, ingress: Ingress) -> None:
    if ingress.operator is None:
        return
    broadcaster = app.state.broadcaster = Broadcaster()
    app.state.websockets = 0  # open here, counted from before the accept
    follower = app.state.follower = EventFollower(ingress, broadcaster)
    tasks: list[asyncio.Task] = []

    async def start() -> None:
        tasks.append(asyncio.get_running_loop().create_task(follower.run()))

    async def stop() -> None:
        follower.stop()
        for task in tasks:
            task.cancel()

    app.router.on_startup.append(start)
    app.router.on_shutdown.append(stop)


@router.websocket("/ws")
async def events(websocket: WebSocket) -> None:
    ingress: Ingress = websocket.app.state.ingress
    broadcaster: Broadcaster | None = getattr(websocket.app.state, "broadcaster", None)
    if broadcaster is None:
        await websocket.close(code=1008, reason="the operator API is turned off")
        return
    if cross_site(websocket.headers, ingress.config.cors_origins):
        # Browsers let any page open a WebSocket anywhere: only this site's may.
        await websocket.close(code=1008, reason="refused: a page from another site")
        return
    if websocket.app.state.websockets >= ingress.config.operator.max_websocket_clients:
        await websocket.close(code=1013, reason="too many clients: try again later")
        return
    websocket.app.state.websockets += 1
    try:
        await _serve(websocket, ingress, broadcaster)
    finally:
        websocket.app.state.websockets -= 1


async def _serve(websocket: WebSocket, ingress: Ingress, broadcaster: Broadcaster) -> None:
    offered = websocket.scope.get("subprotocols", ())
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    with contextlib.suppress(TimeoutError):  # the operator starting: events come later
        await asyncio.wait_for(websocket.app.state.follower.ready.wait(), READY_TIMEOUT_S)
    client = broadcaster.join()
    try:
        snapshot = [
            ("download_status", await manage(ingress, "downloads.list", None, None)),
            ("inference_status", await manage(ingress, "inference.list", None)),
        ]
        for kind, items in snapshot:
            for item in items:
                event = {"event": kind, "data": item, "seq": 0}
                await websocket.send_json(_shown(websocket, event))
        await _pump(websocket, client, ingress)
    except WebSocketDisconnect:
        pass
    finally:
        broadcaster.leave(client)


async def _pump(websocket: WebSocket, client: Client, ingress: Ingress) -> None:
    """Send events until the client leaves or falls too far behind; read its messages."""
    reader = asyncio.ensure_future(_read(websocket, ingress))
    dropped = asyncio.ensure_future(client.dropped.wait())
    try:
        while True:
            getter = asyncio.ensure_future(client.queue.get())
            done, _ = await asyncio.wait(
                {getter, reader, dropped}, return_when=asyncio.FIRST_COMPLETED
            )
            if getter not in done:
                getter.cancel()
                if dropped in done:
                    await websocket.close(code=1013, reason="too slow: events dropped")
                return
            # A client that stops reading stalls its send (uvicorn), or, under Serve, the
            # proxy's buffer grows: either way a send that takes this long drops it.
            try:
                event = _shown(websocket, getter.result())
                await asyncio.wait_for(websocket.send_json(event), SEND_TIMEOUT_S)
            except TimeoutError:
                await websocket.close(code=1013, reason="too slow")
                return
    finally:
        for task in (reader, dropped):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def _caller(websocket: WebSocket) -> Caller:
    return websocket.scope.get("state", {}).get("caller") or Caller()


def _shown(websocket: WebSocket, event: dict) -> dict:
    """The event as this client may see it: no host detail unless it is the operator."""
    return event if _caller(websocket).operator else without_host_detail(event)


async def _read(websocket: WebSocket, ingress: Ingress) -> None:
    caller = _caller(websocket)
    while True:
        text = await websocket.receive_text()
        if len(text) > MAX_CLIENT_MESSAGE:
            await websocket.close(code=1009, reason="message too big")
            return
        with contextlib.suppress(ValueError, AttributeError, RecursionError):
            text = json.loads(text).get("type", "")
        if text == "shutdown" and not caller.operator:
            message = "refused: shutdown needs an admin key (admin_api_keys), or a client on "
            message += "the server's own machine when none is set"
            await websocket.send_json({"event": "error", "data": {"message": message}})
        elif text == "shutdown":
            logger.info("shutdown asked over the WebSocket")
            await operator_call(ingress, "drain", "websocket")
