"""Inference control: a model alias started and stopped at run time, each as its own
Serve application holding one ModelServer deployment, beside the running Shoal app.

Starting one never redeploys the rest: the other models' replicas, and their streams,
are not touched. An item goes queued -> preparing -> inferring, or error; stop takes it
to complete (cancelling while it was still preparing). Every change is published as an
`inference_status` event, which is also how each ingress replica learns that an alias
can be served (it then asks `running()` for the alias's config).
"""

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from app.engine.config import EngineConfig
from app.protocol.errors import ConflictError, InvalidRequestError, NotFoundError
from deployments.config import AppConfig, ModelDeploymentConfig

logger = logging.getLogger("ray.serve")
ALIAS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}$")  # Ollama names: '/' and ':'

LIVE = ("queued", "preparing", "inferring", "cancelling")


def _log_failure(future: "asyncio.Future[None]") -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("inference store: %r", future.exception())


class Deployer(Protocol):
    """Puts a model's deployment on the cluster and takes it off (deployments/operator/
    serve_deployer.py on Serve). All block: they run in worker threads."""

    def deploy(self, config: ModelDeploymentConfig) -> None: ...

    def remove(self, alias: str) -> None: ...

    def is_running(self, alias: str) -> bool: ...

    def app_for(self, alias: str) -> str: ...

    def teardown(self, apps: list[str], own: str) -> None: ...


class ItemStore(Protocol):
    """Where items outlive the operator (inference_store.py)."""

    def all(self) -> list["WingmanItem"]: ...

    def save(self, item: "WingmanItem") -> None: ...

    def delete(self, alias: str) -> None: ...


@dataclass
class WingmanItem:
    alias: str
    model_repo: str
    file_path: str
    context_size: int
    gpu_layers: int
    status: str = "queued"
    error: str = ""
    config: ModelDeploymentConfig | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    updated: int = field(default_factory=lambda: int(time.time()))

    def as_api(self) -> dict[str, Any]:
        return {
            "isa": "WingmanItem",
            "alias": self.alias,
            "status": self.status,
            "modelRepo": self.model_repo,
            "filePath": self.file_path,
            "address": "",  # Serve places the replicas; clients reach them by `model`
            "port": 0,
            "contextSize": self.context_size,
            "gpuLayers": self.gpu_layers,
            "chatTemplate": "",
            "force": False,
            "error": self.error,
            "created": self.created,
            "updated": self.updated,
        }


class InferenceManager:
    def __init__(
        self,
        config: AppConfig,
        deployer: Deployer,
        locate: Callable[[str, str | None], Path | None],
        publish: Callable[[dict[str, Any]], None],
        store: ItemStore | None = None,
    ) -> None:
        self.config = config
        self.deployer = deployer
        self.locate = locate  # (modelRepo, filePath) -> a complete download, or None
        self.publish = publish
        self.store = store
        # One writer thread: the saves of an item land in the order they were made.
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="shoal-inference-store")
        self.items: dict[str, WingmanItem] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    async def start(self) -> None:
        """Load the items a previous operator left: an alias whose application still
        runs is served again as it is; one that was on its way is started again."""
        if self.store is None:
            return
        loop = asyncio.get_running_loop()
        for item in await loop.run_in_executor(self.writer, self.store.all):
            self.items[item.alias] = item
            if item.status not in LIVE:
                continue
            running = await asyncio.to_thread(self.deployer.is_running, item.alias)
            if item.status == "cancelling":
                await self._guarded(asyncio.to_thread, self.deployer.remove, item.alias, item=item)
                item.status = "complete"
            elif running:
                item.status = "inferring"
            else:
                item.status = "queued"
                self.tasks[item.alias] = loop.create_task(self._deploy(item))
            self._changed(item)

    def list(self, alias: str | None = None) -> list[dict[str, Any]]:
        return [i.as_api() for i in self.items.values() if alias is None or i.alias == alias]

    def running(self) -> dict[str, dict[str, Any]]:
        """alias -> its ModelDeploymentConfig (as a dict), for the aliases being served."""
        return {
            a: i.config.model_dump(mode="json")
            for a, i in self.items.items()
            if i.status == "inferring" and i.config is not None
        }

    async def start_alias(
        self,
        alias: str,
        model_repo: str,
        file_path: str | None,
        context_size: int = 0,
        gpu_layers: int = 0,
        chat_template: str = "",
    ) -> dict[str, Any]:
        if not ALIAS.match(alias) or ".." in alias:
            raise InvalidRequestError(f"alias {alias!r}: letters, digits and . _ - / :", "alias")
        if self.config.model(alias) is not None or alias == self.config.embeddings.name:
            raise ConflictError(f"{alias!r} is a configured model's name", "alias")
        if chat_template:
            raise InvalidRequestError(
                "chatTemplate: the model's own template is used", "chatTemplate"
            )
        current = self.items.get(alias)
        if current is not None and current.status in LIVE:
            raise ConflictError(f"{alias!r} is {current.status}: stop it first", "alias")
        location = self.locate(model_repo, file_path)
        if location is None:
            raise NotFoundError(
                f"{model_repo} {file_path or ''} is not downloaded: /api/downloads/enqueue it",
                "modelRepo",
            )
        engine = EngineConfig(model=str(location), max_model_len=context_size or None)
        item = WingmanItem(alias, model_repo, file_path or "", context_size, gpu_layers)
        item.config = ModelDeploymentConfig(
            name=alias, engine=engine, num_cpus=self.config.operator.model_num_cpus
        )
        self.items[alias] = item
        self._changed(item)
        self.tasks[alias] = asyncio.get_running_loop().create_task(self._deploy(item))
        return item.as_api()

    async def stop(self, alias: str) -> dict[str, Any]:
        item = self._find(alias)
        if item.status in LIVE:
            item.status = "cancelling"
            self._changed(item)
            await self._guarded(asyncio.to_thread, self.deployer.remove, alias, item=item)
            task = self.tasks.get(alias)
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
                # A deploy that reached Serve after the first removal is taken off too.
                await self._guarded(asyncio.to_thread, self.deployer.remove, alias, item=item)
            if item.status == "cancelling":
                item.status = "complete"
                self._changed(item)
        return item.as_api()

    async def reset(self, alias: str) -> dict[str, Any]:
        await self.stop(alias)
        item = self.items.pop(alias, None)
        if item is None:  # a concurrent reset took it
            raise NotFoundError(f"no inference item {alias!r}", "alias")
        if self.store is not None:
            await asyncio.get_running_loop().run_in_executor(self.writer, self.store.delete, alias)
        return item.as_api()

    async def end_all(self) -> None:
        """Every item complete, saved (the drain: the applications go with the app)."""
        for item in self.items.values():
            if item.status in LIVE:
                item.status = "complete"
                self._changed(item)
        await asyncio.get_running_loop().run_in_executor(self.writer, lambda: None)

    async def _deploy(self, item: WingmanItem) -> None:
        try:
            if item.status != "queued":  # stopped before it began
                return
            item.status = "preparing"
            self._changed(item)
            assert item.config is not None
            await self._guarded(self._deploy_within, item.config, item=item)
            if item.status == "preparing":
                item.status = "inferring"
                self._changed(item)
        finally:
            self.tasks.pop(item.alias, None)

    async def _deploy_within(self, config: ModelDeploymentConfig) -> None:
        """Deploy, or fail after model_start_timeout_s (replicas Serve cannot place, say,
        would leave it waiting for ever); the caller then takes it off again."""
        deploying = asyncio.ensure_future(asyncio.to_thread(self.deployer.deploy, config))
        # Once taken off after a timeout, the deploy ends with an error nobody awaits.
        deploying.add_done_callback(lambda f: f.cancelled() or f.exception())
        limit = self.config.operator.model_start_timeout_s
        done, _ = await asyncio.wait({deploying}, timeout=limit)
        if not done:
            raise TimeoutError(f"{config.name} did not start within {limit:g} s")
        deploying.result()

    async def _guarded(
        self, fn: Callable[..., Awaitable[None]], *args: Any, item: WingmanItem
    ) -> None:
        """Run a deploy or remove; a failure puts the item in error with its reason."""
        try:
            await fn(*args)
        except Exception as exc:
            logger.warning("inference %s: %r", item.alias, exc)
            if item.status != "cancelling":
                item.status, item.error = "error", str(exc)[:2000] or type(exc).__name__
                self._changed(item)
                # A half-made application holds resources: take it off again.
                await asyncio.to_thread(self._remove_quietly, item.alias)

    def _remove_quietly(self, alias: str) -> None:
        try:
            self.deployer.remove(alias)
        except Exception as exc:
            logger.warning("inference %s: removing it failed: %r", alias, exc)

    def _changed(self, item: WingmanItem) -> None:
        item.updated = int(time.time())
        self.publish(item.as_api())
        if self.store is not None:
            future = asyncio.get_running_loop().run_in_executor(
                self.writer, self.store.save, replace(item)
            )
            future.add_done_callback(_log_failure)

    def _find(self, alias: str) -> WingmanItem:
        item = self.items.get(alias)
        if item is None:
            raise NotFoundError(f"no inference item {alias!r}", "alias")
        return item
