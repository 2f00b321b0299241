"""Saving a context's tokens and KV cache to a file, and loading it back (llama.cpp's slot
save/restore). Plain torch files under one configured directory.

A file records which model and cache layout wrote it; restoring it into another model,
dtype or block size, or from a damaged file, raises InvalidRequestError and touches
nothing. Names are checked before any path is built: letters, digits, `.`, `_` and `-`
only (which rules out separators, `..`, control characters and look-alike Unicode), at
most 255 bytes, no leading dot.
"""

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from app.protocol.errors import InvalidRequestError

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
FORMAT = "shoal-slot-v1"


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
    path: Path, fingerprint: dict[str, Any], tokens: list[int], computed: int, kv: torch.Tensor
) -> int:
    """Write atomically (temp file + rename): a crash never leaves half a file."""
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


def load(path: Path, fingerprint: dict[str, Any]) -> tuple[list[int], int, torch.Tensor]:
    if not path.is_file():
        raise InvalidRequestError(f"no saved slot named {path.name!r}", param="filename")
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
    return tokens, computed, kv
