"""The model catalog (GET /api/models): configured, downloaded and running models as the
spec's AIModel and DownloadableItem objects, each with the memory it would take.

Memory is estimated from the weights' own headers (safetensors or GGUF): the parameter
count times two bytes, because the engine holds weights in bfloat16 whatever the file's
quantisation, plus the KV cache the engine reserves. A model is inferable when that fits
in the memory free on the cluster's roomiest node (one replica lives on one node).
"""

import contextlib
import json
import struct
from pathlib import Path
from typing import Any

from app.engine.config import EngineConfig
from app.models.source import DEFAULT_MODEL, default_model_path, resolve_model
from app.protocol.errors import ModelLoadError
from deployments.config import AppConfig
from deployments.operator.sources import on_disk

WEIGHT_BYTES = 2  # bfloat16


def parameter_count(path: Path) -> int:
    """Parameters in a GGUF file or a directory of safetensors files (0 if unreadable)."""
    try:
        if path.is_file() and path.suffix == ".gguf":
            from app.models.gguf_reader import QuickGGUFReader

            return sum(int(t.n_elements) for t in QuickGGUFReader(str(path)).tensors)
        total = 0
        for file in sorted(path.glob("*.safetensors")):
            with file.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, meta in header.items():
                if name != "__metadata__":
                    n = 1
                    for dim in meta["shape"]:
                        n *= dim
                    total += n
        return total
    except Exception:
        return 0


def memory_required(path: Path, engine: EngineConfig) -> int:
    return parameter_count(path) * WEIGHT_BYTES + int(engine.kv_cache_memory_gib * (1 << 30))


def _item(
    repo: str, file_path: str, location: str | None, done: bool, need: int, free: int
) -> dict:
    quant = Path(file_path).stem.rsplit(".", 1)[-1] if file_path.endswith(".gguf") else ""
    return {
        "isa": "DownloadableItem",
        "modelRepo": repo,
        "modelRepoName": repo.split("/")[-1],
        "filePath": file_path,
        "quantization": quant.lower(),
        "quantizationName": quant,
        "isDownloaded": done,
        "available": True,
        "hasError": False,
        "location": location or "",
        "isInferable": done and 0 < need <= free,
        "normalizedQuantizedMemRequired": need,
    }


def _model(
    model_id: str, vendor: str, location: str, items: list[dict], mem: dict, **more: Any
) -> dict:
    need = max((i["normalizedQuantizedMemRequired"] for i in items), default=0)
    max_length = more.pop("max_length", 0)
    return {
        "isa": "AIModel",
        "id": model_id,
        "name": model_id.split("/")[-1],
        "maxLength": max_length,
        "tokenLimit": max_length,
        "vendor": vendor,
        "location": location,
        "items": items,
        "downloads": 0,
        "likes": 0,
        "created": "",
        "updated": "",
        "size": f"{need / 1e9:.2f} GB",
        "iQScore": 0,
        "eQScore": 0,
        "isInferable": any(i["isInferable"] for i in items),
        "totalMemory": mem["total"],
        "availableMemory": mem["available"],
        "normalizedQuantizedMemRequired": need,
        **more,
    }


def _local_weights(name: str) -> Path | None:
    """A configured model's weights on this machine; None for a Hub repo id (resolving
    it would download it here)."""
    local = Path(name).expanduser()
    if name not in ("", "default", DEFAULT_MODEL) and not local.exists():
        return None
    source = resolve_model(name)
    return source.directory / source.gguf_file if source.gguf_file else source.directory


def catalog(
    config: AppConfig, downloads: list[dict], running: dict[str, str], hardware: dict
) -> list[dict]:
    """`downloads`: DownloadItem dicts; `running`: alias -> modelRepo for started aliases;
    `hardware`: cluster_hardware()'s reading."""
    nodes = [n for n in hardware.get("nodes", []) if "memory" in n]
    roomiest = max(nodes, key=lambda n: n["memory"]["available"], default=None)
    mem = roomiest["memory"] if roomiest else {"total": 0, "available": 0}
    models = []
    for m in config.models:
        path = _local_weights(m.engine.model)
        need = memory_required(path, m.engine) if path else 0
        gguf = path.name if path and path.suffix == ".gguf" else ""
        item = _item(m.engine.model, gguf, str(path or m.engine.model), True, need, mem["total"])
        item["isInferable"] = True  # it is being served
        models.append(
            _model(
                m.name,
                "configured",
                str(path),
                [item],
                mem,
                running=[m.name],
                max_length=m.engine.max_model_len or 0,
            )
        )
    by_repo: dict[str, list[dict]] = {}
    for d in downloads:
        location = json.loads(d["metadata"]).get("location")
        done = d["status"] == "complete" and bool(location)
        need = memory_required(Path(location), EngineConfig()) if done else 0
        by_repo.setdefault(d["modelRepo"], []).append(
            _item(d["modelRepo"], d["filePath"], location, done, need, mem["available"])
        )
    for repo, items in by_repo.items():
        aliases = [a for a, r in running.items() if r == repo]
        models.append(_model(repo, repo.split("/")[0], "hub", items, mem, running=aliases))
    return models + _on_disk(config, set(by_repo), running, mem)


def _on_disk(config: AppConfig, listed: set[str], running: dict[str, str], mem: dict) -> list:
    """The installed model package and what lies under models_dir that no download made
    (copied there, a volume, an earlier install): each startable by its name as
    modelRepo."""
    found: list[tuple[str, str, Path, list[str]]] = []
    with contextlib.suppress(ModelLoadError):  # not installed: nothing to list
        found.append(("default", "package", default_model_path(), [""]))
    root = Path(config.operator.models_dir).expanduser()
    for name, files in on_disk(root):
        if not any(name == r or name.startswith(f"{r}/") for r in listed):
            found.append((name, "local", root / name, files))
    models = []
    for name, vendor, path, files in found:
        items = []
        for file in files:
            where = path / file if file else path
            need = memory_required(where, EngineConfig())
            items.append(_item(name, file, str(where), True, need, mem["available"]))
        aliases = [a for a, r in running.items() if r == name]
        models.append(_model(name, vendor, str(path), items, mem, running=aliases))
    return models
