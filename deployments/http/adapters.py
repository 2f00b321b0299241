"""LoRA adapters by name, in every dialect: a request's model may name a served model's
adapter as `base:adapter` (Ray Serve LLM's spelling) or by the adapter's own name (vLLM's).
Every dialect finds its model through the Ingress (`find_model`), which notes the adapter
here, per request (a context variable, as client_scope keeps the client), and runs the
request's generations with it, so that no dialect has to carry it along.

A model's adapters are its config's `engine.loras` and those loaded at run time
(LoraAdapters.runtime: the operator keeps them, in its database, for every ingress
replica; without an operator, this replica alone).
"""

from contextvars import ContextVar
from pathlib import Path
from typing import Any

from app.engine.config import check_lora_name
from app.protocol.errors import InvalidRequestError, NotFoundError
from app.protocol.lora_ids import adapter_id
from app.protocol.sampling import SamplingParams

MAX_HANDLES = 1024
# A model's adapters: name -> (directory, load version; 0 for the config's).
Adapters = dict[str, tuple[str, int]]
# (model, adapter, its directory, its adapter_id) of the current request
_named: ContextVar[tuple[str, str, str, str] | None] = ContextVar("shoal_adapter", default=None)


class LoraAdapters:
    def __init__(self, models_dir: str) -> None:
        # Run-time adapters may only be read from under here (as downloads land): an API
        # call never names an arbitrary file of the server's.
        self.models_dir = Path(models_dir).expanduser()
        self.runtime: dict[str, Adapters] = {}  # model -> its adapters loaded at run time
        self._handles: dict[tuple[str, str], tuple[Any, Any]] = {}

    def handle(self, model: str, handle: Any, adapter: str | None) -> Any:
        """`handle` (model's) for a call that runs the adapter whose adapter_id is
        `adapter`: Serve's multiplexing sends it to a replica holding it
        (replica_adapters.py). Kept: `.options()` costs more than a request should pay."""
        if adapter is None:
            return handle
        key = (model, adapter)
        kept = self._handles.get(key)
        if kept is None or kept[0] is not handle:  # new, or the model's handle changed
            if len(self._handles) >= MAX_HANDLES:
                self._handles.clear()
            kept = self._handles[key] = (handle, handle.options(multiplexed_model_id=key[1]))
        return kept[1]

    def of(self, model: Any) -> Adapters:
        """The adapters of the ModelDeploymentConfig `model`: the config's win over a run
        time's of the same name (a row left from before a config change)."""
        config = {name: (path, 0) for name, path in model.engine.loras.items()}
        return {**self.runtime.get(model.name, {}), **config}

    def find(self, models: list[Any], name: str) -> Any:
        """The ModelDeploymentConfig among `models` that has the adapter `name` names, the
        adapter noted for the current request; None when it names none. `base:x` of a
        served base that has adapters, none x, is a 404 (but for Ollama's `:latest`; a
        base without adapters keeps its other names' meaning, Ollama tags and files)."""
        if not name:
            return None
        base, colon, adapter = name.rpartition(":")
        for model in models:
            loras = self.of(model)
            of_base = bool(colon) and base in (model.name, *model.aliases)
            if of_base and loras and adapter not in loras and adapter != "latest":
                raise NotFoundError(f"model {base!r} has no LoRA adapter {adapter!r}", "model")
            if (of_base and adapter in loras) or name in loras:
                chosen = adapter if of_base else name
                path, version = loras[chosen]
                _named.set((model.name, chosen, path, adapter_id(chosen, path, version)))
                return model
        return None

    def checked_path(self, path: str) -> str:
        """`path` (relative: to models_dir) as a PEFT directory or a LoRA GGUF under
        models_dir; 400 if not."""
        root = self.models_dir.resolve()
        try:
            full = (root / Path(path).expanduser()).resolve()
            usable = full.is_dir() or (full.is_file() and full.suffix == ".gguf")
        except (OSError, ValueError, RuntimeError) as exc:  # a NUL, a name too long, a loop
            raise InvalidRequestError(f"lora_path: {exc}", "lora_path") from None
        if not full.is_relative_to(root):
            raise InvalidRequestError(
                f"lora_path must be a directory under the models directory {str(root)!r}",
                "lora_path",
            )
        if not usable:
            raise InvalidRequestError(
                f"lora_path {path!r} is neither a directory nor a .gguf file", "lora_path"
            )
        return str(full)


def checked_name(name: str, served: list[Any]) -> str:
    """A new adapter's name, as config adapters' names are checked (EngineConfig), and
    naming no served model."""
    try:
        check_lora_name(name)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), "lora_name") from None
    if any(name in (m.name, *m.aliases) for m in served):
        raise InvalidRequestError(f"{name!r} names a served model", "lora_name")
    return name


def named_adapter(model: str) -> str | None:
    """The adapter of `model` the current request named, if any."""
    named = _named.get()
    return named[1] if named is not None and named[0] == model else None


def named_adapter_path(model: str) -> str | None:
    """The directory of the adapter of `model` the current request named, if any."""
    named = _named.get()
    return named[2] if named is not None and named[0] == model else None


def with_named_adapter(model: str, params: SamplingParams) -> SamplingParams:
    """`params` with the adapter of `model` the current request named, if any, by its
    adapter_id (the engine holds adapters by id)."""
    named = _named.get()
    if named is None or named[0] != model or params.lora is not None:
        return params
    return params.model_copy(update={"lora": named[3]})


def forget_named_adapter() -> Any:
    """A new request names no adapter yet; returns the token that restores the last."""
    return _named.set(None)


def restore_named_adapter(token: Any) -> None:
    _named.reset(token)
