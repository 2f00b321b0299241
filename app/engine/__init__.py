"""The inference engine: plain Python and torch, no Ray, no HTTP."""

from app.engine.config import EngineConfig
from app.engine.engine import LLMEngine

__all__ = ["EngineConfig", "LLMEngine"]
