"""ModelServer: one replica = one engine (in its own process); streams token deltas back to
the ingress."""

import logging
from collections.abc import AsyncIterator

from ray import serve

from app.config import ModelDeploymentConfig
from app.engine.engine_process import EngineProcess
from app.engine.pacing import StreamPacer
from app.protocol.errors import ShoalError
from app.protocol.messages import EngineErrorMessage, GenerateRequest
from app.protocol.outputs import TokenDelta

logger = logging.getLogger("ray.serve")


class ModelServer:
    def __init__(self, config: ModelDeploymentConfig) -> None:
        self.config = config
        # The step loop runs in a child process with its own thread count (Ray sets
        # OMP_NUM_THREADS to num_cpus here), so this process's event loop, which handles
        # every token of every stream, never holds the GIL against it.
        self.engine = EngineProcess(config.engine)
        self.pacer = StreamPacer(config.stream_messages_per_s)
        logger.info("model %s ready", config.name)

    async def generate(
        self, request: GenerateRequest
    ) -> AsyncIterator[TokenDelta | EngineErrorMessage]:
        """Yields the first delta as soon as the engine produces it; later ones are paced
        by the replica's message budget (see StreamPacer)."""
        logger.info(
            "request %s: %d prompt tokens", request.request_id, len(request.prompt_token_ids)
        )
        try:
            deltas = self.engine.generate(
                request.request_id, request.prompt_token_ids, request.params
            )
            async for delta in self.pacer.pace(deltas):
                yield delta
        except ShoalError as exc:
            yield EngineErrorMessage(exc.status_code, exc.error_type, exc.message, exc.param)
        except Exception as exc:  # the engine died under this request
            logger.exception("request %s failed", request.request_id)
            yield EngineErrorMessage(503, "engine_error", f"the model replica failed: {exc}")

    async def stats(self) -> dict:
        stats = await self.engine.call("stats")
        stats["engine_pid"] = self.engine.pid
        stats["replica"] = serve.get_replica_context().replica_id.unique_id
        return stats

    def check_health(self) -> None:
        self.engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


# Three failed checks in a row replace the replica: a dead engine is gone within ~15 s.
ModelServerDeployment = serve.deployment(ModelServer, name="ModelServer", health_check_period_s=5)
