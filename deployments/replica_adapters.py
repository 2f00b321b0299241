"""ReplicaAdapters: the LoRA adapters a ModelServer replica holds, as Serve's model
multiplexing sees them.

An adapter load is known everywhere by its `adapter_id`: its name, directory and load
version (a load that replaces one of the same name, even from the same directory, is a
new id). The ingress puts the id in a request's sampling params (the engine holds
adapters by id, so two loads of one name never share a slot) and its directory in
`EngineRequest.lora_path`, and sends it with the id as Serve's `multiplexed_model_id`. The
replica makes sure its engine holds the adapter before the request goes in, through
Serve's `@serve.multiplexed` loader: Serve then knows which adapters each replica holds
(at most `max_loras`, least recently used out, as in the engine) and the model's router
(affinity_router.py) sends a request to a replica that holds its adapter first, else to
one holding the fewest.

The engine alone decides what its memory holds (app/engine/adapters.py): an adapter that
Serve still lists but the engine dropped for room is read again when a request names
it, so the two views differing costs a read, never a wrong answer.
"""

import logging
from typing import Any

from ray import serve

from app.engine.client import EngineClient
from app.engine.config import EngineConfig
from app.protocol.errors import InvalidRequestError, ShoalError, UnavailableError
from app.protocol.lora_ids import adapter_id, shown

logger = logging.getLogger("ray.serve")


def keyed_engine_config(engine: EngineConfig) -> EngineConfig:
    """The engine config a replica runs: its config adapters held by their ids."""
    loras = {adapter_id(name, path): path for name, path in engine.loras.items()}
    return engine.model_copy(update={"loras": loras})


def _in_serve_replica() -> bool:
    try:
        serve.get_replica_context()
    except Exception:  # noqa: BLE001 (in-process tests: no Serve around)
        return False
    return True


class ReplicaAdapters:
    def __init__(self, engine: EngineClient, max_loras: int) -> None:
        self.engine = engine
        self._paths: dict[str, str] = {}  # adapter_id -> directory

        async def load(key: str) -> str:
            await self.engine.set_lora(key, self._paths[key])
            return key

        # A function, not a bound method: Serve keeps its cache on the object it wraps.
        self._load: Any = load
        if max_loras > 0 and _in_serve_replica():
            self._load = serve.multiplexed(max_num_models_per_replica=max_loras)(load)

    async def load(self, key: str, path: str) -> None:
        """Load an adapter now (the API's load call): one that cannot be read or does not
        fit the model is a 400, with the reason, before any request names it."""
        self._paths[key] = path
        await self._load(key)

    async def hold(self, key: str, path: str) -> None:
        """Make the engine hold the adapter a request runs, now the most recently used.
        Its files failing now (they were read once, at its load) is the server's fault: a
        503 that names no path; the reason goes to the log."""
        try:
            await self.load(key, path)
        except ShoalError as exc:  # from the engine's process: a RemoteError of its status
            if exc.status_code != InvalidRequestError.status_code:
                raise
            logger.warning("LoRA adapter %s: %s", key, exc.message)
            raise UnavailableError(
                f"LoRA adapter {shown(key)!r} cannot be read on this replica now"
            ) from None
