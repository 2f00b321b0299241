"""A tensor-parallel shard other than rank 0: its slice of the weights and of the KV cache.

Rank 0 (the engine: scheduler, sampler) broadcasts each step's StepInputs; every shard
runs the same forward pass on its slice, meeting the others in the all-reduces. Between
steps rank 0 broadcasts a heartbeat now and then, so a shard never waits long enough to
time out, and a dead peer shows up as an error at the next collective. `None` stops.

In Serve the replica's shard actors call `run_shard`; `python -m app.engine.shard` runs
one as a plain process (tests, benchmarks, debugging).
"""

import argparse
import logging
import sys

import torch

from app.engine.config import EngineConfig
from app.engine.input_batch import StepInputs
from app.engine.model_runner import load_runner
from app.models.parallel import init_tp_group

logger = logging.getLogger(__name__)

HEARTBEAT = "heartbeat"


def run_shard(config: EngineConfig, rank: int, master: str) -> None:
    """Join rank 0's group at `master` ("host:port"), load this slice, run steps until
    rank 0 stops; raises when a peer fails."""
    torch.set_num_threads(config.threads)
    tp = init_tp_group(rank, config.tensor_parallel_size, master, config.torch_distributed_backend)
    try:
        _, runner = load_runner(config, tp)
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
