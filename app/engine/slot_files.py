"""Saving a context's tokens and KV cache to a file, and loading it back (llama.cpp's slot
save/restore). Plain torch files under one configured directory.

A file records which model and cache layout wrote it; restoring it into another model,
dtype or block size, or from a damaged file, raises InvalidRequestError and touches
nothing. Names are checked before any path is built: letters, digits, `.`, `_` and `-`
only (which rules out separators, `..`, control characters and look-alike Unicode), at
most 255 bytes, no leading dot.

torch is imported by the functions that read or write a file, not by the module: a
ModelServer replica checks names here (`checked_path`) and maps no libtorch (its engine
process does the saving and loading).
"""

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.protocol.errors import ConflictError, InvalidRequestError, NotImplementedByServerError

if TYPE_CHECKING:
    import torch

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
FORMAT = "shoal-slot-v1"
SAFE_TORCH = (2, 6)  # the first torch whose weights_only load has no known bypass


def __getattr__(name: str) -> Any:
    if name == "torch":  # `slot_files.torch`, as before torch was imported lazily
        import torch

        return torch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def directory_usage(directory: Path, exclude: Path | None = None) -> int:
    total = 0
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=False) and Path(entry.path) != exclude:
            total += entry.stat(follow_symlinks=False).st_size
    return total


def check_quota(path: Path, new_bytes: int, quota_bytes: int) -> None:
    """Refuse a save that would take the slot directory past its quota (a file being
    replaced does not count)."""
    used = directory_usage(path.parent, exclude=path)
    if used + new_bytes > quota_bytes:
        raise ConflictError(
            f"saving about {new_bytes} bytes would take the slot directory to "
            f"{used + new_bytes} bytes, past its quota of {quota_bytes} (slot_save_quota_bytes); "
            "the operator must remove files from it",
            param="filename",
        )


def checked_path(directory: str | Path, filename: str) -> Path:
    if not isinstance(filename, str) or not _NAME.fullmatch(filename) or ".." in filename:
        raise InvalidRequestError(
            "filename must be 1-255 characters of A-Z, a-z, 0-9, '.', '_' or '-', "
            "not starting with '.' and without '..'",
            param="filename",
        )
    root = Path(directory).resolve()
    path = (root / filename).resolve()
    if path.parent != root:  # belt and braces: never outside the directory
        raise InvalidRequestError("filename must name a file in the slot directory", "filename")
    return path


def save(
    path: Path, fingerprint: dict[str, Any], tokens: list[int], computed: int, kv: "torch.Tensor"
) -> int:
    """Write atomically (temp file + rename): a crash never leaves half a file."""
    import torch

    payload = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "tokens": tokens,
        "computed": computed,
        "kv": kv,
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


@dataclass(frozen=True)
class SlotFile:
    """What a file held: its tokens, how many of them have KV, the KV, the file's size."""

    tokens: list[int]
    computed: int
    kv: "torch.Tensor"  # (layers, 2, blocks, *block shape), on the CPU
    num_bytes: int


def load(path: Path, fingerprint: dict[str, Any], max_bytes: int) -> SlotFile:
    """Read and check a file written by `save`; refuse one over `max_bytes` unread."""
    import torch

    if torch_version() < SAFE_TORCH:
        raise NotImplementedByServerError(
            f"slot restore needs torch >= {SAFE_TORCH[0]}.{SAFE_TORCH[1]} (CVE-2025-32434), "
            f"this server has {torch.__version__}"
        )
    if not path.is_file():
        raise InvalidRequestError(f"no saved slot named {path.name!r}", param="filename")
    size = path.stat().st_size
    if size > max_bytes:
        raise InvalidRequestError(
            f"{path.name!r} is {size} bytes, more than a slot of this model can take ({max_bytes})",
            param="filename",
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        ok = isinstance(payload, dict) and payload.get("format") == FORMAT
        tokens, computed, kv = payload["tokens"], payload["computed"], payload["kv"]
    except Exception as exc:
        raise InvalidRequestError(f"{path.name!r} is not a readable slot file: {exc}") from None
    if not (
        ok
        and isinstance(kv, torch.Tensor)
        and isinstance(tokens, list)
        and all(isinstance(t, int) for t in tokens)
        and isinstance(computed, int)
        and 0 <= computed <= len(tokens)
    ):
        raise InvalidRequestError(f"{path.name!r} is not a slot file", param="filename")
    if payload.get("fingerprint") != fingerprint:
        raise InvalidRequestError(
            f"{path.name!r} was saved by another model or cache layout "
            f"({payload.get('fingerprint')}), this one is {fingerprint}",
            param="filename",
        )
    return SlotFile(tokens, computed, kv, size)
