"""ShardActor: one tensor-parallel shard (rank >= 1) of a model replica, as a Ray actor.

The replica creates its shards in its own placement group (one bundle each, STRICT_PACK),
so they land on its node with their own CPUs or GPU, and they share the replica's fate:
Ray kills actors whose owner dies.
"""

import logging
import os
import socket

import ray
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from app.engine.config import EngineConfig
from deployments.config import ModelDeploymentConfig

logger = logging.getLogger("ray.serve")


@ray.remote(max_concurrency=2)  # `run` holds one thread for the replica's life; `pid` the other
class ShardActor:
    def run(self, config_json: str, rank: int, master: str) -> None:
        # torch and the model are imported here, in the shard's own process: the replica
        # that imports this module to start its shards maps no libtorch.
        from app.engine.shard import run_shard

        config = EngineConfig.model_validate_json(config_json)
        # Ray sets OMP_NUM_THREADS to this actor's num_cpus; the shard wants its own count.
        os.environ["OMP_NUM_THREADS"] = str(config.threads)
        run_shard(config, rank, master)

    def pid(self) -> int:
        return os.getpid()


SHARD_NAMESPACE = "shoal-shards"


class ShardGroup:
    """A replica's ShardActors (ranks 1..N-1), each in its own bundle of the replica's
    placement group, named `{model}-{replica}-{rank}` in SHARD_NAMESPACE."""

    def __init__(self, config: ModelDeploymentConfig, replica_id: str) -> None:
        self.config = config
        self.replica_id = replica_id
        self.actors: list = []
        self.names: list[str] = []
        self.runs: list = []

    def start(self) -> str:
        """Start ranks 1..N-1; returns rank 0's address ("host:port"), where the
        replica's engine process will meet them."""
        engine, size = self.config.engine, self.config.engine.tensor_parallel_size
        group = get_current_placement_group()
        if group is None:
            raise RuntimeError("tensor_parallel_size > 1 needs the replica's placement group")
        with socket.socket() as s:  # rank 0 (the engine process) listens here
            s.bind(("", 0))
            port = s.getsockname()[1]
        master = f"{ray.util.get_node_ip_address()}:{port}"
        for rank in range(1, size):
            name = f"{self.config.name}-{self.replica_id}-{rank}"
            actor = ShardActor.options(
                name=name,
                namespace=SHARD_NAMESPACE,
                num_cpus=self.config.num_cpus / size,
                num_gpus=self.config.num_gpus / size,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=rank
                ),
            ).remote()
            self.names.append(name)
            self.actors.append(actor)
            self.runs.append(actor.run.remote(engine.model_dump_json(), rank, master))
        logger.info("model %s: %d shards, rank 0 at %s", self.config.name, size, master)
        return master

    def check(self) -> None:
        """Raise if a shard's loop has ended: it only ends with its replica, so the group
        is broken."""
        ended, _ = ray.wait(self.runs, timeout=0) if self.runs else ([], None)
        if ended:
            raise RuntimeError("a tensor-parallel shard of this replica has stopped")

    def stop(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors.clear()
