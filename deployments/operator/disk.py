"""How much a download may take: a total quota on models_dir (409) and a floor of free
space on its filesystem (507), both checked when a download is asked for (before any
byte) and while its bytes arrive (the disk is shared: something else may fill it)."""

import os
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from app.protocol.errors import ConflictError, ShoalError
from deployments.database_config import OPERATOR_STATE


class QuotaExceededError(ConflictError):
    code = "download_quota_exceeded"


class InsufficientStorageError(ShoalError):
    status_code = 507
    error_type = "insufficient_storage"
    code = "insufficient_storage"


@dataclass(frozen=True)
class DiskLimits:
    max_total_bytes: int | None  # models_dir's bytes plus those still to come; None: no quota
    min_free_bytes: int
    min_free_fraction: float

    def check(self, models_dir: Path, incoming: int, used: int | None = None) -> None:
        """Refuse when `incoming` more bytes (what every download under way, and the new
        one, still has to fetch) would pass the quota or leave less free space than the
        floor. `used`: models_dir's bytes, when the caller has them already."""
        if self.max_total_bytes is not None:
            used = disk_used(models_dir) if used is None else used
            if used + incoming > self.max_total_bytes:
                raise QuotaExceededError(
                    f"the download quota would be passed: {used} bytes in models_dir and "
                    f"{incoming} to come, over {self.max_total_bytes}",
                    param="modelRepo",
                )
        self.check_free(models_dir, incoming)

    def check_free(self, models_dir: Path, incoming: int) -> None:
        usage = shutil.disk_usage(_existing(models_dir))
        floor = max(self.min_free_bytes, int(usage.total * self.min_free_fraction))
        if usage.free - incoming < floor:
            raise InsufficientStorageError(
                f"not enough free disk space: {usage.free} bytes free, {incoming} to come, "
                f"and {floor} must stay free",
                param="modelRepo",
            )


def disk_used(root: Path) -> int:
    """The bytes of every file under `root` (links not followed), but the operator's own
    state (a few kilobytes, and not a download)."""
    total, stack = 0, [root]
    state = root / PurePosixPath(OPERATOR_STATE).parts[0]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:  # gone meanwhile, or not a directory
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    if Path(entry.path) != state:
                        stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    return total


def _existing(path: Path) -> Path:
    """`path`, or its nearest existing parent (models_dir is made on the first download)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
