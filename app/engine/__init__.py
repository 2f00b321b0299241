"""The inference engine: plain Python and torch, no Ray, no HTTP.

Importing the package imports no torch: EngineConfig is plain pydantic (the Ingress,
registry, operator and `serve run` driver validate it), and LLMEngine (torch and the
models) is imported when first asked for, through PEP 562's module `__getattr__`."""

from typing import TYPE_CHECKING, Any

from app.engine.config import EngineConfig

if TYPE_CHECKING:
    from app.engine.engine import LLMEngine

__all__ = ["EngineConfig", "LLMEngine"]


def __getattr__(name: str) -> Any:
    if name == "LLMEngine":
        from app.engine.engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'app.engine' has no attribute {name!r}")
