"""LoRA adapters by name, in every dialect: a request's model may name a served model's
adapter as `base:adapter` (Ray Serve LLM's spelling) or by the adapter's own name (vLLM's).
Every dialect finds its model through the Ingress (`find_model`), which notes the adapter
here, per request (a context variable, as client_scope keeps the client), and runs the
request's generations with it, so that no dialect has to carry it along.
"""

from contextvars import ContextVar
from typing import Any

from app.protocol.errors import NotFoundError
from app.protocol.sampling import SamplingParams

_named: ContextVar[tuple[str, str] | None] = ContextVar("shoal_adapter", default=None)


def find_adapter(models: list[Any], name: str) -> Any:
    """The ModelDeploymentConfig among `models` that has the adapter `name` names, the
    adapter noted for the current request; None when it names none. `base:x` of a
    served base that has adapters, none x, is a 404 (but for Ollama's `:latest`; a base
    without adapters keeps its other names' meaning, Ollama tags and file names)."""
    if not name:
        return None
    base, colon, adapter = name.rpartition(":")
    for model in models:
        loras = model.engine.loras
        of_base = bool(colon) and base in (model.name, *model.aliases)
        if of_base and loras and adapter not in loras and adapter != "latest":
            raise NotFoundError(f"model {base!r} has no LoRA adapter {adapter!r}", "model")
        if (of_base and adapter in loras) or name in loras:
            _named.set((model.name, adapter if of_base else name))
            return model
    return None


def named_adapter(model: str) -> str | None:
    """The adapter of `model` the current request named, if any."""
    named = _named.get()
    return named[1] if named is not None and named[0] == model else None


def with_named_adapter(model: str, params: SamplingParams) -> SamplingParams:
    """`params` with the adapter of `model` the current request named, if any."""
    adapter = named_adapter(model)
    if adapter is None or params.lora is not None:
        return params
    return params.model_copy(update={"lora": adapter})


def forget_named_adapter() -> Any:
    """A new request names no adapter yet; returns the token that restores the last."""
    return _named.set(None)


def restore_named_adapter(token: Any) -> None:
    _named.reset(token)
