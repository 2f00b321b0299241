"""LoRA adapters loaded and unloaded at run time, for the routes that do it: vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter, and the operator API's
/api/lora-adapters. Both are operator actions (operator_calls.operator_action).

A load reads the adapter on one replica first (Serve's multiplexing sends it there, and
then sends the adapter's requests there first), so a bad file is refused before any
request names it; then the operator records it (its database, for every ingress
replica, which follow its events), or, with no operator, this ingress replica alone. An
unloaded adapter is named by no request again; a replica frees its weights when newer
adapters need the room.
"""

import time
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from app.protocol.errors import InvalidRequestError, NotFoundError
from app.protocol.lora_ids import adapter_id
from deployments.api.operator_calls import operator_call
from deployments.http.adapters import checked_name
from deployments.http.generation import overloaded, replica_failure
from deployments.ingress import Ingress, unwrap


def listed(ingress: Ingress) -> list[dict[str, Any]]:
    """Every adapter of every served model, whence it came."""
    return [
        {
            "model": m.name,
            "name": name,
            "path": path,
            "source": "config" if name in m.engine.loras else "runtime",
        }
        for m in ingress.served_models()
        for name, (path, _) in ingress.loras.of(m).items()
    ]


async def load_lora(
    ingress: Ingress, model: str | None, name: str, path: str, replace: bool = False
) -> str:
    """Load adapter `name` from `path` for `model` (default: the first served model);
    returns the model's name. Every load is a new version, read anew by the replicas
    (`replace`: of a run-time adapter of that name, vLLM's `load_inplace`)."""
    config = ingress.model(ingress.default_model(model))
    checked_name(name, ingress.served_models())
    holder = next((m for m in ingress.served_models() if name in ingress.loras.of(m)), None)
    if holder is not None and not (replace and name in ingress.loras.runtime.get(holder.name, {})):
        raise InvalidRequestError(
            f"The lora adapter '{name}' has already been loaded.", "lora_name"
        )
    if config.engine.max_loras < 1:
        raise InvalidRequestError(f"model {config.name!r} takes no LoRA adapters (max_loras 0)")
    path = ingress.loras.checked_path(path)
    version = time.time_ns() // 1000  # a new id: no replica takes an earlier read for it
    key = adapter_id(name, path, version)
    handle = ingress.loras.handle(config.name, ingress.handle(config.name), key)
    try:
        await handle.load_adapter.remote(key, path)
    except BackPressureError as exc:
        raise overloaded(exc) from None
    except RayActorError as exc:
        raise replica_failure(exc) from None
    except Exception as exc:
        raise unwrap(exc) from None
    if ingress.operator is not None:
        await operator_call(ingress, "add_lora", config.name, name, path, version, replace)
    for held in ingress.loras.runtime.values():
        held.pop(name, None)
    ingress.loras.runtime.setdefault(config.name, {})[name] = (path, version)
    return config.name


async def unload_lora(ingress: Ingress, name: str) -> None:
    """Unload the run-time adapter `name` (404 if none; 400 for a config's)."""
    if any(name in m.engine.loras for m in ingress.served_models()):
        raise InvalidRequestError(f"the lora adapter '{name}' is set in the config", "lora_name")
    if ingress.operator is not None:
        known = await operator_call(ingress, "remove_lora", name)
    else:
        known = any(name in held for held in ingress.loras.runtime.values())
    for held in ingress.loras.runtime.values():
        held.pop(name, None)
    if not known:
        raise NotFoundError(f"The lora adapter '{name}' cannot be found.", "lora_name")
