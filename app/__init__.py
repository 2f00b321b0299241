"""Shoal: LLM serving on Ray Serve.

Importing `app` has no side effects. `serve run app:graph` reaches the Serve
application through PEP 562's module `__getattr__`, so the builder (and Ray)
are imported only when the graph is asked for.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "graph":
        from app.builder import build_default_app

        return build_default_app()
    raise AttributeError(f"module 'app' has no attribute {name!r}")
