"""The ingress's side of the operator: one task per ingress replica that follows the
operator's event log (a long poll) and

- serves the aliases the operator starts and stops (`inference_status` events),
- knows the LoRA adapters loaded at run time (`lora_adapters` events),
- stops taking requests when the operator drains the app, and reports how many are still
  open until they are none,
- hands every event to this replica's WebSocket clients (Broadcaster).

A client whose queue is full is dropped (closed with 1013, "try again later") rather than
buffered without bound: one slow page never holds the server's memory.
"""

import asyncio
import contextlib
import logging
from typing import Any

from ray import serve

from deployments.config import ModelDeploymentConfig
from deployments.ingress import Ingress
from deployments.model_deployment import model_deployment_name

logger = logging.getLogger("ray.serve")
CLIENT_QUEUE = 256  # events a WebSocket client may fall behind by before it is dropped
POLL_S = 10.0
REPORT_EVERY_S = 0.25


class Client:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(CLIENT_QUEUE)
        self.dropped = asyncio.Event()


class Broadcaster:
    def __init__(self) -> None:
        self.clients: set[Client] = set()

    def join(self) -> Client:
        client = Client()
        self.clients.add(client)
        return client

    def leave(self, client: Client) -> None:
        self.clients.discard(client)

    def send(self, event: dict[str, Any]) -> None:
        for client in list(self.clients):
            try:
                client.queue.put_nowait(event)
            except asyncio.QueueFull:
                logger.warning("websocket client too slow: dropped")
                client.dropped.set()
                self.leave(client)


class EventFollower:
    def __init__(self, ingress: Ingress, broadcaster: Broadcaster) -> None:
        self.ingress = ingress
        self.operator = ingress.operator
        self.broadcaster = broadcaster
        self.replica = _replica_id()
        self._reporter: asyncio.Task | None = None
        self._retry = False  # an alias failed to load here: try again at the next poll
        self._adapters_retry = False
        # Set once the first poll has fixed where this replica starts in the log: a client
        # that joins before it would miss what the first batch held.
        self.ready = asyncio.Event()

    async def run(self) -> None:
        seq, first = 0, True
        while True:
            try:
                # The first call returns at once: where the log is now, not replayed.
                batch = await self.operator.events_since.remote(seq, 0.0 if first else POLL_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the operator restarting: try again shortly
                logger.warning("operator events unavailable: %r", exc)
                await asyncio.sleep(1.0)
                continue
            events = batch["events"]
            restarted = batch["seq"] < seq  # a new operator: its numbers started again
            if restarted and not any(_is_drain(e) for e in events):
                self.ingress.admission.draining = False  # a drain its death cut short
            changed = _names(events, "inference_status")
            if first or restarted or batch["lost"] or changed or self._retry:
                await self._sync_models()
            adapters = _names(events, "lora_adapters") or self._adapters_retry
            if first or restarted or batch["lost"] or adapters:
                await self._sync_adapters()
            for event in events:
                if _is_drain(event):
                    self._drain()
                if not first:  # a new follower does not replay the log to its clients
                    self.broadcaster.send(event)
            seq, first = batch["seq"], False
            self.ready.set()

    async def _sync_models(self) -> None:
        try:
            running = await self.operator.running.remote()
        except Exception as exc:
            logger.warning("operator models unavailable: %r", exc)
            return
        self._retry = False
        for alias, current in list(self.ingress.runtime_models.items()):
            entry = running.get(alias)
            if entry is None or ModelDeploymentConfig.model_validate(entry["config"]) != current:
                self.ingress.remove_model(alias)  # gone, or started again on other weights
        for alias, entry in running.items():
            if alias in self.ingress.runtime_models:
                continue
            config = ModelDeploymentConfig.model_validate(entry["config"])
            handle = serve.get_deployment_handle(model_deployment_name(alias), entry["app"])
            try:
                await self.ingress.add_model(config, handle)
                logger.info("serving %s (started at run time)", alias)
            except Exception as exc:
                logger.warning("cannot serve %s: %r", alias, exc)
                self._retry = True

    async def _sync_adapters(self) -> None:
        """The LoRA adapters loaded at run time, as the operator's database has them."""
        self._adapters_retry = False
        try:
            self.ingress.loras.runtime = await self.operator.lora_adapters.remote()
        except Exception as exc:
            logger.warning("operator adapters unavailable: %r", exc)
            self._adapters_retry = True  # at the next poll

    def _drain(self) -> None:
        self.ingress.admission.draining = True
        if self._reporter is None:
            self._reporter = asyncio.get_running_loop().create_task(self._report())

    async def _report(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.operator.report_inflight.remote(
                    self.replica, self.ingress.admission.open
                )
            await asyncio.sleep(REPORT_EVERY_S)

    def stop(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()


def _names(events: list[dict[str, Any]], name: str) -> bool:
    return any(e["event"] == name for e in events)


def _is_drain(event: dict[str, Any]) -> bool:
    return event["event"] == "status" and event["data"].get("state") == "draining"


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # in-process tests
        return "local"
