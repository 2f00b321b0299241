"""Shoal: LLM serving on Ray Serve.

Importing `app` has no side effects. `serve run app:graph` reaches the application
builder (deployments.builder.graph, which takes typed args) through PEP 562's module
`__getattr__`, so Ray is imported only when the graph is asked for.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "graph":
        from deployments.builder import graph

        return graph
    raise AttributeError(f"module 'app' has no attribute {name!r}")
