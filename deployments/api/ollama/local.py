"""The models on the server's disk that /api/tags lists beside the served ones, as
Ollama lists every pulled model whether loaded or not: the model package, downloads and
files under the operator's models_dir (whatever put them there)."""

import logging
from datetime import UTC, datetime

from deployments.api.operator_calls import operator_call
from deployments.ingress import Ingress

logger = logging.getLogger("ray.serve")


async def local_tags(ingress: Ingress, served: list[str]) -> list[dict]:
    """Tags entries for what is on disk and not served under that name already."""
    if ingress.operator is None:
        return []
    try:
        found = await operator_call(ingress, "local_models")
    except Exception as exc:  # the served models are still listed
        logger.warning("ollama tags: no operator: %r", exc)
        return []
    names = set(served)
    now = datetime.fromtimestamp(ingress.created, UTC).isoformat()
    return [
        {
            "name": f"{m['name']}:latest" if ":" not in m["name"] else m["name"],
            "model": f"{m['name']}:latest" if ":" not in m["name"] else m["name"],
            "modified_at": now,
            "size": m["size"],
            "digest": "",
            "details": {
                "format": m["format"],
                "family": "",
                "families": [],
                "parameter_size": "",
                "quantization_level": "",
            },
        }
        for m in found
        if m["name"] not in names
    ]
