"""The Hugging Face Hub (or a mirror of it) as the operator sees it: which files a repo
has at which commit, and one file fetched into a local directory, resumably.

Everything goes through huggingface_hub (its API client for the listing, its URL rules,
its `http_get` for the bytes) over one guarded HTTP client (deployments/url_guard.py). huggingface_hub
keeps one client per process, so `Hub` installs its client factory: in a Serve replica
that process is the operator's own.
"""

import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import httpx2
import huggingface_hub
from huggingface_hub import HfApi, constants, file_download, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
)
from huggingface_hub.hf_api import RepoSibling
from tqdm import tqdm

from app.protocol.errors import InvalidRequestError, NotFoundError, ShoalError
from deployments.url_guard import HostPolicy, guarded_client

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
CHUNK_BYTES = 1 << 20
PART_SUFFIX = ".part"  # a file being fetched; its size is where a resume starts


class HubError(ShoalError):
    status_code = 502
    error_type = "bad_gateway"


class DownloadCancelled(Exception):
    """Raised from a fetch's progress callback to stop it (the partial file stays)."""


@dataclass(frozen=True)
class RemoteFile:
    path: str  # inside the repo
    size: int
    # What the bytes must hash to, as the hub lists them: an LFS file's sha256, else the
    # git blob id (sha1 of "blob <size>\0" + the bytes). None: the hub gave neither.
    sha256: str | None = None
    blob_id: str | None = None

    def verify(self, path: Path) -> None:
        """HubError unless the file at `path` hashes as listed."""
        if self.sha256:
            kind, want, digest = "sha256", self.sha256, hashlib.sha256()
        elif self.blob_id:
            kind, want, digest = "git blob id", self.blob_id, hashlib.sha1()
            digest.update(b"blob %d\0" % self.size)
        else:
            return
        with path.open("rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
        if digest.hexdigest() != want.lower():
            raise HubError(f"{self.path}: its {kind} is {digest.hexdigest()}, the hub lists {want}")


@dataclass(frozen=True)
class RepoFiles:
    commit: str  # every file is fetched at this commit, so a resume never mixes two
    files: list[RemoteFile]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def check_repo(repo: str) -> str:
    if not REPO_ID.match(repo) or ".." in repo:
        raise InvalidRequestError(f"modelRepo {repo!r} is not a repo id (owner/name)", "modelRepo")
    return repo


def check_file_path(path: str) -> str:
    """A relative path inside the repo: never absolute, never climbing out of it."""
    pure = PurePosixPath(path)
    if not path or "\\" in path or "\0" in path or pure.is_absolute() or ".." in pure.parts:
        raise InvalidRequestError(f"filePath {path!r} is not a path inside the repo", "filePath")
    return str(pure)


class Hub:
    def __init__(self, endpoint: str, token: str | None, policy: HostPolicy) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.token = token or False  # False: never a token from the environment or disk
        # Xet storage downloads through its own Rust client, past this guard: plain HTTP only.
        constants.HF_HUB_DISABLE_XET = True
        # Its default of 10 MB per chunk would make progress and cancel that coarse.
        constants.DOWNLOAD_CHUNK_SIZE = CHUNK_BYTES
        os.environ["HF_HUB_DISABLE_XET"] = "1"
        huggingface_hub.set_client_factory(lambda: guarded_client(policy))
        self.api = HfApi(endpoint=self.endpoint, token=self.token)

    def files(self, repo: str, file_path: str | None, commit: str | None = None) -> RepoFiles:
        """The repo's files at `commit` (default: its head), only `file_path` if given."""
        try:
            info = self.api.model_info(repo, revision=commit, files_metadata=True)
        except (RepositoryNotFoundError, GatedRepoError) as exc:
            raise NotFoundError(f"repo {repo!r} not found on {self.endpoint}", "modelRepo") from exc
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else 0
            if status in (401, 403, 404):
                message = f"repo {repo!r} not found on {self.endpoint}"
                raise NotFoundError(message, "modelRepo") from None
            raise HubError(f"the hub answered {status or exc}") from None
        except httpx2.TransportError as exc:
            raise HubError(f"cannot reach {self.endpoint}: {exc}") from None
        files = [_remote_file(s) for s in info.siblings or []]
        for f in files:  # a hostile mirror's listing must not write outside the repo's folder
            try:
                check_file_path(f.path)
            except InvalidRequestError:
                raise HubError(f"the hub listed an unsafe path {f.path!r}") from None
        if file_path is not None:
            files = [f for f in files if f.path == file_path]
            if not files:
                raise NotFoundError(f"{repo!r} has no file {file_path!r}", "filePath")
        return RepoFiles(str(info.sha), files)

    def fetch(
        self, repo: str, commit: str, file: RemoteFile, into: Path, on_bytes: Callable[[int], None]
    ) -> Path:
        """`file` at `commit` into `into/<path>`, resuming a `.part` left by an earlier
        try. `on_bytes(n)` hears every chunk and may raise DownloadCancelled."""
        target = into / file.path
        if target.is_file() and target.stat().st_size == file.size:
            return target
        part = target.with_name(target.name + PART_SUFFIX)
        part.parent.mkdir(parents=True, exist_ok=True)
        done = part.stat().st_size if part.exists() else 0
        if done > file.size:  # not ours to trust: start again
            part.unlink()
            done = 0
        url = hf_hub_url(repo, file.path, revision=commit, endpoint=self.endpoint)
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            with part.open("ab") as out:
                file_download.http_get(
                    url,
                    out,
                    resume_size=done,
                    headers=headers,
                    expected_size=file.size,
                    tqdm_class=_progress_class(on_bytes),
                )
        except EntryNotFoundError as exc:
            raise NotFoundError(f"{repo!r} has no file {file.path!r}", "filePath") from exc
        got = part.stat().st_size
        if got != file.size:
            part.unlink()
            raise HubError(f"{file.path}: got {got} bytes, the hub listed {file.size}")
        try:  # the whole file, a resumed part's earlier bytes included
            file.verify(part)
        except HubError:
            part.unlink()  # a corrupt file is never kept, nor resumed from
            raise
        part.replace(target)
        return target


def _remote_file(sibling: RepoSibling) -> RemoteFile:
    # An LFS file's blob id is its pointer's, not its content's: only its sha256 tells.
    sha256 = sibling.lfs.sha256 if sibling.lfs else None
    blob_id = None if sibling.lfs else sibling.blob_id
    return RemoteFile(sibling.rfilename, int(sibling.size or 0), sha256, blob_id)


def _progress_class(on_bytes: Callable[[int], None]) -> type[tqdm]:
    class Progress(tqdm):
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["disable"] = True  # no bar in the server log
            kwargs.pop("name", None)
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            on_bytes(int(n or 0))
            return super().update(n)

    return Progress
