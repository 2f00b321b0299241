"""Downloads: enqueue, cancel, reset and list, each item fetched from the hub in a worker
thread (at most `max_concurrent_downloads` at once), its progress published as
`download_status` events and saved, so that a restart lists the truth and resumes what
was queued or downloading from the bytes already on disk.

Files land in `<models_dir>/<owner>/<name>/<path in the repo>`.
"""

import asyncio
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.protocol.errors import NotFoundError, ShoalError
from deployments.operator.disk import DiskLimits
from deployments.operator.hub import (
    PART_SUFFIX,
    DownloadCancelled,
    Hub,
    RemoteFile,
    RepoFiles,
    check_file_path,
    check_repo,
)
from deployments.state.downloads import ACTIVE, DownloadState, DownloadStore

logger = logging.getLogger("ray.serve")
PUBLISH_EVERY_S = 0.5  # progress events and saves while bytes arrive


class TooLargeError(ShoalError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "download_too_large"


class _Progress:
    """One running download's counters, shared with its worker thread."""

    def __init__(self, state: DownloadState) -> None:
        self.state = state
        self.cancel = threading.Event()
        self.speed_bps = 0.0
        self._mark = (time.monotonic(), state.downloaded_bytes)


class DownloadManager:
    def __init__(
        self,
        hub: Hub,
        store: DownloadStore,
        models_dir: Path,
        max_bytes: int,
        max_concurrent: int,
        publish: Callable[[dict[str, Any]], None],
        limits: DiskLimits | None = None,
    ) -> None:
        self.hub, self.store, self.models_dir = hub, store, models_dir
        self.max_bytes = max_bytes
        self.limits = limits or DiskLimits(None, 0, 0.0)
        # Admitting a download (the quota and the free space, then its bytes reserved as
        # a queued item) is one step at a time: two enqueues cannot both take the last room.
        self.admitting = asyncio.Lock()
        self.publish = publish  # gets each changed item's API dict, on the event loop
        self.items: dict[tuple[str, str], DownloadState] = {}
        self.running: dict[tuple[str, str], _Progress] = {}
        self.tasks: dict[tuple[str, str], asyncio.Task] = {}
        self.slots = asyncio.Semaphore(max_concurrent)
        # One change at a time per item: two enqueues must not start two writers.
        self.locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.repo_locks: dict[str, asyncio.Lock] = {}

    async def start(self) -> None:
        """Load the list; what a stop interrupted goes on from where it was."""
        for state in await asyncio.to_thread(self.store.all):
            self.items[(state.model_repo, state.file_path)] = state
            if state.status in ACTIVE:
                self._spawn(state)

    # ---- the API -----------------------------------------------------------------------
    def list(self, model_repo: str | None = None, file_path: str | None = None) -> list[dict]:
        return [
            self.as_api(s)
            for s in self.items.values()
            if (model_repo is None or s.model_repo == model_repo)
            and (file_path is None or s.file_path == file_path)
        ]

    def as_api(self, state: DownloadState) -> dict[str, Any]:
        progress = self.running.get((state.model_repo, state.file_path))
        return state.as_api(progress.speed_bps if progress else 0.0)

    def _lock(self, key: tuple[str, str]) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())

    async def enqueue(self, model_repo: str, file_path: str | None) -> dict[str, Any]:
        key = self._key(model_repo, file_path)
        async with self._lock(key):
            return await self._enqueue(key, model_repo, file_path)

    async def _enqueue(
        self, key: tuple[str, str], model_repo: str, file_path: str | None
    ) -> dict[str, Any]:
        state = self.items.get(key)
        if state is not None and (state.status in ACTIVE or state.status == "complete"):
            return self.as_api(state)
        # Asked now, not in the worker, so that a missing repo or one over the cap is the
        # caller's error at once rather than an item in `error`.
        files = await asyncio.to_thread(self.hub.files, key[0], file_path)
        if files.total_bytes > self.max_bytes:
            raise TooLargeError(
                f"{model_repo} {file_path or ''} is {files.total_bytes} bytes, over this "
                f"server's limit of {self.max_bytes}",
                param="modelRepo",
            )
        async with self.admitting:
            same = state is not None and state.commit == files.commit
            incoming = self._to_come() + files.total_bytes - (state.downloaded_bytes if same else 0)
            await asyncio.to_thread(self.limits.check, self.models_dir, incoming)
            if state is None:
                state = DownloadState(key[0], key[1], "queued", created=int(time.time()))
                self.items[key] = state
            if state.commit is not None and state.commit != files.commit:
                # Another commit: what is on disk is the old one's, never to be mixed in.
                await asyncio.to_thread(self._remove_files, state)
                state.downloaded_bytes = 0
            state.status, state.error = "queued", None
            state.commit, state.total_bytes = files.commit, files.total_bytes
        await self._changed(state)
        self._spawn(state, files)
        return self.as_api(state)

    async def cancel(self, model_repo: str, file_path: str | None) -> dict[str, Any]:
        state = self._find(model_repo, file_path)
        async with self._lock((state.model_repo, state.file_path)):
            if state.status in ACTIVE:
                await self._stop(state)
                if state.status in ACTIVE:  # it may have completed meanwhile
                    state.status = "cancelled"
                    await self._changed(state)
        return self.as_api(state)

    async def reset(self, model_repo: str, file_path: str | None) -> dict[str, Any]:
        """Stop it, delete its files and forget it."""
        state = self._find(model_repo, file_path)
        # A whole repo's files include its single files': those items go with it.
        gone = [state] + [
            s
            for s in self.items.values()
            if not state.file_path and s.model_repo == state.model_repo and s.file_path
        ]
        for item in gone:
            key = (item.model_repo, item.file_path)
            async with self._lock(key):
                await self._stop(item)
                await asyncio.to_thread(self._remove_files, item)
                if self.items.pop(key, None) is not None:
                    await asyncio.to_thread(self.store.delete, *key)
                    item.status, item.downloaded_bytes, item.location = "idle", 0, None
                    self.publish(self.as_api(item))
            self.locks.pop(key, None)
        return self.as_api(state)

    def location(self, model_repo: str, file_path: str | None) -> Path | None:
        """Where a complete download is, or None."""
        state = self.items.get(self._key(model_repo, file_path))
        if state is None or state.status != "complete" or not state.location:
            return None
        return Path(state.location)

    async def close(self) -> None:
        for progress in self.running.values():
            progress.cancel.set()
        for task in list(self.tasks.values()):
            task.cancel()

    # ---- the work ----------------------------------------------------------------------
    def _spawn(self, state: DownloadState, files: RepoFiles | None = None) -> None:
        key = (state.model_repo, state.file_path)
        self.tasks[key] = asyncio.get_running_loop().create_task(self._run(state, files))

    async def _run(self, state: DownloadState, files: RepoFiles | None) -> None:
        key = (state.model_repo, state.file_path)
        progress = _Progress(state)
        self.running[key] = progress
        loop = asyncio.get_running_loop()
        try:
            async with self.slots:
                if progress.cancel.is_set():
                    return
                if files is None:  # resumed after a restart: the same commit's listing
                    files = await asyncio.to_thread(
                        self.hub.files, state.model_repo, state.file_path or None, state.commit
                    )
                if progress.cancel.is_set():
                    return
                state.status = "downloading"
                await self._changed(state)
                # One writer per repo: a whole repo and one of its files share their files.
                async with self.repo_locks.setdefault(state.model_repo, asyncio.Lock()):
                    await asyncio.to_thread(self._fetch, progress, files, loop)
            state.status, state.downloaded_bytes = "complete", state.total_bytes
        except (DownloadCancelled, asyncio.CancelledError):
            return  # cancel() or reset() says what it became
        except Exception as exc:
            logger.warning("download %s/%s failed: %r", state.model_repo, state.file_path, exc)
            state.status, state.error = "error", str(exc) or type(exc).__name__
        finally:
            self.running.pop(key, None)
            self.tasks.pop(key, None)
        await self._changed(state)

    def _fetch(
        self, progress: _Progress, files: RepoFiles, loop: asyncio.AbstractEventLoop
    ) -> None:
        """In a worker thread: every file, counting bytes (resumed parts included)."""
        state = progress.state
        into = self.models_dir / state.model_repo
        done = 0  # bytes of the files already whole
        last = [time.monotonic()]
        for file in files.files:
            target = into / file.path
            if _size(target) == file.size:
                done += file.size
                continue
            part = target.with_name(target.name + PART_SUFFIX)

            def on_bytes(
                n: int, file: RemoteFile = file, part: Path = part, done: int = done
            ) -> None:
                # Counted from the part on disk: a hub that ignores Range restarts it.
                if progress.cancel.is_set():
                    raise DownloadCancelled
                now = time.monotonic()
                if now - last[0] < PUBLISH_EVERY_S:
                    return
                written = _size(part)
                if written > file.size:
                    raise TooLargeError(f"the hub sent more than the {file.size} bytes listed")
                state.downloaded_bytes = done + written
                # The disk is shared: the floor holds while the bytes arrive too.
                self.limits.check_free(self.models_dir, self._to_come())
                t0, b0 = progress._mark
                progress.speed_bps = max(0.0, (state.downloaded_bytes - b0) / max(now - t0, 1e-6))
                progress._mark = (now, state.downloaded_bytes)
                last[0] = now
                self.store.save(state)
                loop.call_soon_threadsafe(self.publish, self.as_api(state))

            self.hub.fetch(state.model_repo, files.commit, file, into, on_bytes)
            done += file.size
            state.downloaded_bytes = done
        single = state.file_path and len(files.files) == 1
        state.location = str(into / files.files[0].path) if single else str(into)

    def _to_come(self) -> int:
        """The bytes the downloads queued or under way have still to fetch."""
        active = [s for s in list(self.items.values()) if s.status in ACTIVE]
        return sum(max(0, s.total_bytes - s.downloaded_bytes) for s in active)

    async def _stop(self, state: DownloadState) -> None:
        key = (state.model_repo, state.file_path)
        progress, task = self.running.get(key), self.tasks.get(key)
        if progress is not None:
            progress.cancel.set()
        if task is not None:
            if state.status == "queued":  # waiting for a slot (or a listing): no writer yet
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _changed(self, state: DownloadState) -> None:
        await asyncio.to_thread(self.store.save, state)
        self.publish(self.as_api(state))

    def _remove_files(self, state: DownloadState) -> None:
        root = (self.models_dir / state.model_repo).resolve()
        if not state.file_path:
            shutil.rmtree(root, ignore_errors=True)
            return
        for path in (root / state.file_path, root / (state.file_path + ".part")):
            path.unlink(missing_ok=True)

    def _find(self, model_repo: str, file_path: str | None) -> DownloadState:
        state = self.items.get(self._key(model_repo, file_path))
        if state is None:
            raise NotFoundError(f"no download of {model_repo} {file_path or ''}", "modelRepo")
        return state

    @staticmethod
    def _key(model_repo: str, file_path: str | None) -> tuple[str, str]:
        return check_repo(model_repo), check_file_path(file_path) if file_path else ""


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0
