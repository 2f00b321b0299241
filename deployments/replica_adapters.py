"""ReplicaAdapters: the LoRA adapters a ModelServer replica holds, as Serve's model
multiplexing sees them.

A request that runs an adapter names it in its sampling params and carries the
adapter's directory (`EngineRequest.lora_path`); the ingress sends it with the adapter's
`adapter_id` as Serve's `multiplexed_model_id`. The replica makes sure its engine holds
the adapter before the request goes in, through Serve's `@serve.multiplexed` loader:
Serve then knows which adapters each replica holds (at most `max_loras`, least recently
used out, as in the engine) and the model's router (affinity_router.py) sends a request
to a replica that holds its adapter first, else to one holding the fewest.

The engine alone decides what its memory holds (app/engine/adapters.py): an adapter that
Serve still lists but the engine dropped for room is read again when a request names
it, so the two views differing costs a read, never a wrong answer.
"""

import hashlib
from typing import Any

from ray import serve

from app.engine.client import EngineClient


def adapter_id(name: str, path: str) -> str:
    """The multiplexed model id of adapter `name` read from `path`: loading another
    directory under the same name is another id, so no router takes a replica holding
    the old one for a holder of the new."""
    return f"{name}@{hashlib.sha256(path.encode()).hexdigest()[:12]}"


def _in_serve_replica() -> bool:
    try:
        serve.get_replica_context()
    except Exception:  # noqa: BLE001 (in-process tests: no Serve around)
        return False
    return True


class ReplicaAdapters:
    def __init__(self, engine: EngineClient, max_loras: int) -> None:
        self.engine = engine
        self._paths: dict[str, tuple[str, str]] = {}  # adapter_id -> (name, path)

        async def load(model_id: str) -> str:
            name, path = self._paths[model_id]
            await self.engine.set_lora(name, path)
            return model_id

        # A function, not a bound method: Serve keeps its cache on the object it wraps.
        self._load: Any = load
        if max_loras > 0 and _in_serve_replica():
            self._load = serve.multiplexed(max_num_models_per_replica=max_loras)(load)

    async def hold(self, name: str, path: str) -> None:
        """Make the engine hold adapter `name` from `path`, the most recently used (400
        when it cannot be read or does not fit the model)."""
        key = adapter_id(name, path)
        self._paths[key] = (name, path)
        await self._load(key)
