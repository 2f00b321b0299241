"""A tensor-parallel shard other than rank 0: its slice of the weights and of the KV cache.

Rank 0 (the engine: scheduler, sampler) broadcasts each step's StepInputs; every shard
runs the same forward pass on its slice, meeting the others in the all-reduces. Between
steps rank 0 broadcasts a heartbeat now and then, so a shard never waits long enough to
time out, and a dead peer shows up as an error at the next collective. `None` stops.

In Serve the replica's shard actors call `run_shard`; `python -m app.engine.shard` runs
one as a plain process (tests, debugging).
"""

import argparse
import logging
import os
import socket
import subprocess
import sys

import torch

from app.engine.config import EngineConfig
from app.engine.model_runner import ModelRunner, StepInputs, num_kv_blocks
from app.models.attention import select_backend
from app.models.loader import load_model
from app.models.parallel import TPGroup, init_tp_group
from app.models.source import resolve_model

logger = logging.getLogger(__name__)

HEARTBEAT = "heartbeat"


def load_shard(config: EngineConfig, tp: TPGroup) -> ModelRunner:
    backend = select_backend(config.attention_backend, config.torch_device, config.block_size)
    loaded = load_model(
        resolve_model(config.model),
        backend,
        config.torch_dtype,
        config.torch_device,
        config.max_model_len,
        tp,
    )
    return ModelRunner(config, loaded.model, backend, num_kv_blocks(config, loaded.model))


def run_shard(config: EngineConfig, rank: int, master: str) -> None:
    """Join rank 0's group at `master` ("host:port"), load this slice, run steps until
    rank 0 stops; raises when a peer fails."""
    torch.set_num_threads(config.threads)
    tp = init_tp_group(rank, config.tensor_parallel_size, master, config.torch_distributed_backend)
    try:
        runner = load_shard(config, tp)
        logger.info("shard %d/%d ready", rank, tp.size)
        while True:
            step = tp.broadcast_object()
            if step is None:
                return
            if isinstance(step, StepInputs):
                runner.execute(step)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def free_local_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def spawn_local_shards(config: EngineConfig, master: str) -> list[subprocess.Popen]:
    """Ranks 1..N-1 as plain processes on this machine (tests and benchmarks; Serve
    replicas use ShardActors instead)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env["OMP_NUM_THREADS"] = str(config.threads)
    return [
        subprocess.Popen(
            [sys.executable, "-m", "app.engine.shard", "--rank", str(rank)]
            + ["--master", master, "--config", config.model_dump_json()],
            env=env,
        )
        for rank in range(1, config.tensor_parallel_size)
    ]


def stop_local_shards(shards: list[subprocess.Popen], timeout_s: float = 15.0) -> None:
    """Wait for shards that rank 0 told to stop; kill the ones that do not."""
    for shard in shards:
        try:
            shard.wait(timeout_s)
        except subprocess.TimeoutExpired:
            shard.kill()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s shard %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(description="one tensor-parallel shard (rank >= 1)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master", required=True, help="host:port of rank 0")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = parser.parse_args()
    run_shard(EngineConfig.model_validate_json(args.config), args.rank, args.master)
    return 0


if __name__ == "__main__":
    sys.exit(main())
