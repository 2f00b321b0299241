"""ShardActor: one tensor-parallel shard (rank >= 1) of a model replica, as a Ray actor.

The replica creates its shards in its own placement group (one bundle each, STRICT_PACK),
so they land on its node with their own CPUs or GPU, and they share the replica's fate:
Ray kills actors whose owner dies.
"""

import os

import ray

from app.engine.config import EngineConfig
from app.engine.shard import run_shard


@ray.remote(max_concurrency=2)  # `run` holds one thread for the replica's life; `pid` the other
class ShardActor:
    def run(self, config_json: str, rank: int, master: str) -> None:
        config = EngineConfig.model_validate_json(config_json)
        # Ray sets OMP_NUM_THREADS to this actor's num_cpus; the shard wants its own count.
        os.environ["OMP_NUM_THREADS"] = str(config.threads)
        run_shard(config, rank, master)

    def pid(self) -> int:
        return os.getpid()
