"""ModelServer: one replica = one engine; streams token deltas back to the ingress."""

import logging
from collections.abc import AsyncIterator

import torch
from ray import serve

from app.config import ModelDeploymentConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.protocol.errors import ShoalError
from app.protocol.messages import EngineErrorMessage, GenerateRequest
from app.protocol.outputs import TokenDelta

logger = logging.getLogger("ray.serve")


class ModelServer:
    def __init__(self, config: ModelDeploymentConfig) -> None:
        self.config = config
        # Ray sets OMP_NUM_THREADS to num_cpus (1 here); the engine picks its own count.
        torch.set_num_threads(config.engine.threads)
        self.engine = AsyncEngine(LLMEngine(config.engine))
        logger.info("model %s ready", config.name)

    async def generate(
        self, request: GenerateRequest
    ) -> AsyncIterator[TokenDelta | EngineErrorMessage]:
        """Yields each delta as soon as the engine produces it (no batching of chunks)."""
        logger.info(
            "request %s: %d prompt tokens", request.request_id, len(request.prompt_token_ids)
        )
        try:
            async for delta in self.engine.generate(
                request.request_id, request.prompt_token_ids, request.params
            ):
                yield delta
        except ShoalError as exc:
            yield EngineErrorMessage(exc.status_code, exc.error_type, exc.message, exc.param)
        except Exception as exc:  # the engine died under this request
            logger.exception("request %s failed", request.request_id)
            yield EngineErrorMessage(503, "engine_error", f"the model replica failed: {exc}")

    def stats(self) -> dict:
        stats = self.engine.engine.stats.as_dict()
        stats["replica"] = serve.get_replica_context().replica_id.unique_id
        return stats

    def check_health(self) -> None:
        self.engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


ModelServerDeployment = serve.deployment(ModelServer, name="ModelServer", health_check_period_s=10)
