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
from collections.abc import Callable
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
POLL_S = 0.5  # how often a starting alias's application is looked at
CALL_S = 10.0  # a call to Serve under way returns within this
STOP_WAIT_S = 8.0  # a stop waits this long in all for its deploy and for the app to go


def _log_failure(future: "asyncio.Future[None]") -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("inference store: %r", future.exception())


class Deployer(Protocol):
    """Puts a model's deployment on the cluster and takes it off (deployments/operator/
    serve_deployer.py on Serve). Each call is short (it asks and returns, never waits for
    replicas), made in the manager's own worker threads; `state` is polled."""

    def deploy(self, config: ModelDeploymentConfig) -> None: ...

    def remove(self, alias: str) -> None: ...

    def state(self, alias: str) -> tuple[str, str]:
        """(status, message): "" (none), DEPLOYING, RUNNING, DEPLOY_FAILED, DELETING, ..."""
        ...

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
        locate: Callable[[str, str | None], Path],
        publish: Callable[[dict[str, Any]], None],
        store: ItemStore | None = None,
    ) -> None:
        self.config = config
        self.deployer = deployer
        self.locate = locate  # (modelRepo, filePath) -> the weights (sources.py), or raises
        self.publish = publish
        self.store = store
        # One writer thread: the saves of an item land in the order they were made.
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="shoal-inference-store")
        # Serve's calls, apart from the loop's default pool (the catalog, downloads): each
        # is short, so however many aliases wait for replicas, stop and reset still answer.
        self.serve_calls = ThreadPoolExecutor(4, thread_name_prefix="shoal-deployer")
        # Deploys in threads of their own: however long Serve's controller takes to
        # take one, stop, remove and state do not queue behind it.
        self.deploy_calls = ThreadPoolExecutor(4, thread_name_prefix="shoal-deploy")
        # Held from start_alias's checks until its item is in `items`: concurrent starts
        # (of one alias, or past max_runtime_models) are refused, not all accepted.
        self.starting = asyncio.Lock()
        self.items: dict[str, WingmanItem] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    async def _serve(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.serve_calls, fn, *args)

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
            running = await self._serve(self.deployer.is_running, item.alias)
            if item.status == "cancelling":
                await self._remove(item)
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
        """Start `alias` from `model_repo` (a model package, a download, a path under
        models_dir: sources.py); returns at once, the item queued."""
        if not ALIAS.match(alias) or ".." in alias:
            raise InvalidRequestError(f"alias {alias!r}: letters, digits and . _ - / :", "alias")
        if self.config.model(alias) is not None or alias == self.config.embeddings.name:
            raise ConflictError(f"{alias!r} is a configured model's name", "alias")
        if chat_template:
            raise InvalidRequestError(
                "chatTemplate: the model's own template is used", "chatTemplate"
            )
        async with self.starting:
            self._may_start(alias)
            configured = self.config.model(model_repo)
            if configured is not None and not file_path:  # the configured weights, again
                location: Path | str = configured.engine.model
            else:
                location = await asyncio.to_thread(self.locate, model_repo, file_path)
            self._may_start(alias)  # a stop or reset went on meanwhile
            engine = EngineConfig(model=str(location), max_model_len=context_size or None)
            item = WingmanItem(alias, model_repo, file_path or "", context_size, gpu_layers)
            item.config = ModelDeploymentConfig(
                name=alias, engine=engine, num_cpus=self.config.operator.model_num_cpus
            )
            self.items[alias] = item
            self._changed(item)
            self.tasks[alias] = asyncio.get_running_loop().create_task(self._deploy(item))
            return item.as_api()

    def _may_start(self, alias: str) -> None:
        """Refuses a start of `alias` while it is live, while a stopped start of it still
        has its deploy under way, or past max_runtime_models."""
        current = self.items.get(alias)
        if current is not None and current.status in LIVE:
            raise ConflictError(f"{alias!r} is {current.status}: stop it first", "alias")
        if alias in self.tasks:  # its stale deploy would remove the new application
            raise ConflictError(f"{alias!r} is still stopping: try again shortly", "alias")
        live = sum(1 for i in self.items.values() if i.status in LIVE)
        limit = self.config.operator.max_runtime_models
        if live >= limit:
            raise ConflictError(
                f"{live} models started at run time already (max_runtime_models {limit}): "
                "stop one first",
                "alias",
            )

    async def stop(self, alias: str) -> dict[str, Any]:
        """Stop `alias`, a starting one too (its application is deleted); it answers
        whatever Serve is doing with the replicas (they go on going away after)."""
        item = self._find(alias)
        if item.status in LIVE:
            item.status = "cancelling"
            self._changed(item)
            deadline = time.monotonic() + STOP_WAIT_S
            task = self.tasks.get(alias)
            if task is not None:  # polling, or in one short call to Serve: it ends soon
                await asyncio.wait({task}, timeout=STOP_WAIT_S)
            await self._remove(item)
            await self._gone(alias, max(0.0, deadline - time.monotonic()))
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
            try:
                await self._deploy_within(item)
            except Exception as exc:
                await self._failed(item, exc)
                return
            if item.status == "preparing":
                item.status = "inferring"
                self._changed(item)
        finally:
            self.tasks.pop(item.alias, None)

    async def _deploy_within(self, item: WingmanItem) -> None:
        """Hand the application to Serve and poll it until its replicas run, or fail
        after model_start_timeout_s (replicas Serve cannot place, say, would leave it
        waiting for ever). A stop meanwhile ends the wait: it deletes the application."""
        assert item.config is not None
        limit = self.config.operator.model_start_timeout_s
        deadline = time.monotonic() + limit
        # The application of an earlier start of this alias, still being deleted.
        if not await self._gone(item.alias, limit):
            raise TimeoutError(f"{item.alias}'s previous application is still being deleted")
        if item.status != "preparing":
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.deploy_calls, self.deployer.deploy, item.config)
        handed = time.monotonic()
        while item.status == "preparing":
            status, message = await self._serve(self.deployer.state, item.alias)
            if status == "RUNNING":
                return
            # None at all, a moment after the deploy: deleted from outside.
            gone = status == "" and time.monotonic() - handed > CALL_S
            if status in ("DEPLOY_FAILED", "DELETING") or gone:
                raise RuntimeError(message or f"{item.alias}: Serve says {status or 'gone'}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{item.alias} did not start within {limit:g} s"
                    + (f": {message}" if message else "")
                )
            await asyncio.sleep(POLL_S)
        # Stopped or reset meanwhile (complete, cancelling): a stop that gave up waiting
        # for the deploy above removed the application before Serve made it; no item
        # owns it now, so it goes (no new start of the alias ran: _may_start).
        await self._remove(item)

    async def _gone(self, alias: str, limit: float) -> bool:
        """Whether the alias has no application (waiting up to `limit` for a deletion)."""
        deadline = time.monotonic() + limit
        while (await self._serve(self.deployer.state, alias))[0]:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True

    async def _failed(self, item: WingmanItem, exc: Exception) -> None:
        """A deploy failed: the item in error with its reason, the half-made
        application (it holds resources) taken off."""
        logger.warning("inference %s: %r", item.alias, exc)
        if item.status == "cancelling":
            return
        item.status, item.error = "error", str(exc)[:2000] or type(exc).__name__
        self._changed(item)
        await self._remove(item)

    async def _remove(self, item: WingmanItem) -> None:
        try:
            await self._serve(self.deployer.remove, item.alias)
        except Exception as exc:
            logger.warning("inference %s: removing it failed: %r", item.alias, exc)

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
