"""Operator: the one Serve deployment (one replica) that holds the operator API's state
for every ingress replica: the download list, the aliases started at run time, the event
log the WebSockets follow, and the drain that ends the application.

It starts its work (resuming downloads, timing metrics) on the first call, which is an
ingress following its events, since a Serve constructor cannot await.
"""

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from ray import serve

from app.protocol.errors import ConflictError, InvalidRequestError, OverloadedError
from deployments.config import AppConfig
from deployments.database_config import operator_state_url
from deployments.operator import sources
from deployments.operator.catalog import catalog
from deployments.operator.disk import DiskLimits
from deployments.operator.downloads import DownloadManager
from deployments.operator.events import EventLog
from deployments.operator.hardware import cluster_hardware
from deployments.operator.hub import Hub
from deployments.operator.inference import LIVE, Deployer, InferenceManager
from deployments.operator.serve_deployer import ServeDeployer
from deployments.state.database import Database
from deployments.state.downloads import DownloadStore
from deployments.state.inference import InferenceStore
from deployments.state.lora_adapters import LoraAdapterStore
from deployments.url_guard import HostPolicy

logger = logging.getLogger("ray.serve")
METRICS_EVERY_S = 2.0  # at most one batch of `metrics` events this often
WATCH_S = 60.0  # the registry long poll's limit (it answers at once on a change)
API_METHODS = {
    f"{owner}.{name}"
    for owner, names in {
        "downloads": ("list", "enqueue", "cancel", "reset"),
        "inference": ("list", "start_alias", "stop", "reset"),
    }.items()
    for name in names
}
HARDWARE_KEPT_S = 5.0


def _app_name() -> str:
    try:
        return serve.get_replica_context().app_name
    except Exception:  # not in a Serve replica (in-process tests)
        return "local"


class Operator:
    def __init__(self, config: AppConfig, registry: Any = None, deployer: Deployer | None = None):
        self.config = config
        self.registry = registry
        self.app_name = _app_name()
        self.events = EventLog()
        self.deployer = deployer or ServeDeployer(self.app_name, registry)
        op = config.operator
        policy = HostPolicy.for_hub(op.hub_endpoint, op.storage_hosts, op.private_hosts)
        # Its own state, never the Assistants' SQLite file (database_config.py says why).
        db = Database(operator_state_url(config.database, op.models_dir, op.state_path))
        self.downloads = DownloadManager(
            Hub(op.hub_endpoint, op.hub_token, policy),
            DownloadStore(db, self.app_name),
            Path(op.models_dir).expanduser(),
            op.max_download_bytes,
            op.max_concurrent_downloads,
            publish=lambda item: self.events.publish("download_status", item),
            limits=DiskLimits(
                op.max_total_download_bytes, op.min_free_disk_bytes, op.min_free_disk_fraction
            ),
        )
        self.inference = InferenceManager(
            config,
            self.deployer,
            self._locate,
            publish=lambda item: self.events.publish("inference_status", item),
            store=InferenceStore(db, self.app_name),
        )
        self.loras = LoraAdapterStore(db, self.app_name)
        self.draining = False
        self.inflight: dict[str, int] = {}  # ingress replica -> requests open, while draining
        self._started: asyncio.Task | None = None
        self._hardware: tuple[float, dict] = (0.0, {})

    def _locate(self, model_repo: str, file_path: str | None) -> Path:
        """The weights a model started at run time loads (sources.py)."""

        def downloaded(repo: str, path: str | None) -> Path | None:
            try:
                return self.downloads.location(repo, path)
            except InvalidRequestError:  # no repo id: a package or a path, not a download
                return None

        def downloading(repo: str) -> bool:
            return any(d["status"] in ("queued", "downloading") for d in self.downloads.list(repo))

        models_dir = Path(self.config.operator.models_dir)
        return sources.locate(models_dir, model_repo, file_path, downloaded, downloading)

    async def _start(self) -> None:
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._resume())
            asyncio.get_running_loop().create_task(self._metrics())
        await asyncio.shield(self._started)

    async def _resume(self) -> None:
        """What a previous operator left; a failure here is logged, never fatal: the API
        must answer even when one stored item cannot be taken up again."""
        for part in (self.downloads.start, self.inference.start):
            try:
                await part()
            except Exception as exc:
                logger.error("operator: resuming %s failed: %r", part.__qualname__, exc)

    # ---- events -------------------------------------------------------------------------
    async def events_since(self, seq: int, timeout_s: float = 10.0) -> dict[str, Any]:
        await self._start()
        return await self.events.since(seq, timeout_s)

    async def _metrics(self) -> None:
        """A `metrics` event for each model whose replicas' figures (their heartbeats)
        changed, at most every METRICS_EVERY_S. It waits on the registry (`watch`, a long
        poll) rather than asking it on a timer, and publishes nothing unchanged: an idle
        app sends no events, so the ingresses' long polls here wait too."""
        if self.registry is None:
            return
        version, published = -1, {}
        while True:
            try:
                version, engines = await self.registry.watch.remote(version, WATCH_S)
            except Exception as exc:
                logger.warning("operator: no engine registry: %r", exc)
                await asyncio.sleep(METRICS_EVERY_S)
                continue
            by_model: dict[str, list[dict]] = {}
            for e in engines:
                by_model.setdefault(e["engine_name"], []).append(e["runtime_info"])
            # A model whose last replica went away is said once more, with none.
            for alias in published.keys() - by_model.keys():
                by_model[alias] = []
            for alias, infos in by_model.items():
                if published.get(alias) != infos:
                    self.events.publish("metrics", _timings(alias, infos))
            published = {alias: infos for alias, infos in by_model.items() if infos}
            await asyncio.sleep(METRICS_EVERY_S)

    # ---- downloads, inference, catalog ----------------------------------------------------
    async def call(self, method: str, *args: Any) -> Any:
        """One of the managers' API methods, by name (`downloads.enqueue`, ...)."""
        if method not in API_METHODS:
            raise ValueError(f"no operator method {method!r}")
        await self._start()
        if self.draining and method in ("downloads.enqueue", "inference.start_alias"):
            raise OverloadedError("the server is shutting down")
        if method == "downloads.reset":
            serving = [
                i["alias"]
                for i in self.inference.list()
                if i["modelRepo"] == args[0] and i["status"] in LIVE
            ]
            if serving:
                raise ConflictError(f"{args[0]} is served as {serving}: stop that first")
        owner, name = method.split(".")
        manager = {"downloads": self.downloads, "inference": self.inference}[owner]
        result = getattr(manager, name)(*args)
        return await result if asyncio.iscoroutine(result) else result

    def running(self) -> dict[str, dict[str, Any]]:
        """alias -> {"config": ModelDeploymentConfig dict, "app": its Serve application}."""
        return {
            alias: {"config": cfg, "app": self.deployer.app_for(alias)}
            for alias, cfg in self.inference.running().items()
        }

    # ---- LoRA adapters loaded at run time (deployments/api/lora_calls.py) -------------------
    def lora_adapters(self) -> dict[str, dict[str, tuple[str, int]]]:
        """model -> adapter -> (directory, load version)."""
        return self.loras.all()

    async def add_lora(
        self, model: str, name: str, path: str, version: int, replace: bool = False
    ) -> None:
        """Record an adapter an ingress loaded; every ingress follows (a `lora_adapters`
        event). One of that name is a 400 unless `replace`."""
        if self.loras.get(name) is not None and not replace:
            raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.")
        self.loras.save(model, name, path, version)
        self.events.publish("lora_adapters", {"model": model, "name": name, "state": "loaded"})

    async def remove_lora(self, name: str) -> bool:
        """False when no adapter has that name."""
        held = self.loras.get(name)
        if held is None or not self.loras.delete(name):
            return False
        self.events.publish("lora_adapters", {"model": held[0], "name": name, "state": "unloaded"})
        return True

    async def hardware(self) -> dict[str, Any]:
        at, reading = self._hardware
        if time.monotonic() - at > HARDWARE_KEPT_S:
            reading = await cluster_hardware()
            self._hardware = (time.monotonic(), reading)
        return reading

    async def models(self) -> list[dict[str, Any]]:
        await self._start()
        running = {
            i["alias"]: i["modelRepo"] for i in self.inference.list() if i["status"] == "inferring"
        }
        hardware = await self.hardware()
        return await asyncio.to_thread(
            catalog, self.config, self.downloads.list(), running, hardware
        )

    async def local_models(self) -> list[dict[str, Any]]:
        """What can be started without a download, as Ollama names it (`repo` or
        `repo:file.gguf`): the model package, complete downloads, files under models_dir."""
        await self._start()
        root = Path(self.config.operator.models_dir).expanduser()
        return await asyncio.to_thread(sources.local_names, root, self.downloads.list())

    # ---- drain --------------------------------------------------------------------------
    async def drain(self, reason: str = "api") -> dict[str, Any]:
        """Start the drain (once): every ingress refuses new requests, the open ones finish
        (up to drain_timeout_s), then this app and its aliases are deleted, and Serve shut
        down when no other application is left on it."""
        await self._start()
        if not self.draining:
            self.draining = True
            logger.info("operator: draining (%s)", reason)
            self.events.publish("status", {"state": "draining", "reason": reason})
            asyncio.get_running_loop().create_task(self._drain())
        return {"status": "draining"}

    def report_inflight(self, replica: str, count: int) -> bool:
        self.inflight[replica] = count
        return self.draining

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.config.operator.drain_timeout_s
        self.inflight.clear()
        while time.monotonic() < deadline:
            reported = len(self.inflight) >= self.config.ingress_replicas
            if reported and not any(self.inflight.values()):
                break
            await asyncio.sleep(0.25)
        self.events.publish("status", {"state": "stopping"})
        await self.downloads.close()
        await asyncio.sleep(0.5)  # lets the last events reach the followers
        apps = [self.deployer.app_for(a) for a in self.inference.items]
        await self.inference.end_all()  # a shut-down app starts again without its aliases
        self.deployer.teardown(apps, self.app_name)


def _timings(alias: str, infos: list[dict]) -> dict[str, Any]:
    tokens_per_s = sum(i.get("tokens_per_s", 0.0) for i in infos)
    return {
        "alias": alias,
        "meta": {"replicas": len(infos)},
        "system": {},
        "tensors": {},
        "timings": {
            "timestamp": int(time.time()),
            "predicted_per_second": tokens_per_s,
            "sample_per_second": tokens_per_s,
            "running": sum(i.get("num_running", 0) for i in infos),
            "waiting": sum(i.get("num_waiting", 0) for i in infos),
            "kv_usage": max((i.get("kv_usage", 0.0) for i in infos), default=0.0),
        },
    }


OperatorDeployment = serve.deployment(Operator, name="Operator")
