"""What every node of the Ray cluster has: CPUs, memory and GPUs (NVML where present),
read on the node itself by a zero-CPU task pinned there."""

import asyncio
import os
import platform
from typing import Any

import psutil
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[dict[str, Any]]:
    try:
        import pynvml  # nvidia-ml-py, where the node has it
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: no GPU to report
        return []
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append(
                {
                    "index": i,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "totalMemory": int(mem.total),
                    "freeMemory": int(mem.free),
                    "utilization": pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                }
            )
        return gpus
    finally:
        pynvml.nvmlShutdown()


def local_hardware() -> dict[str, Any]:
    mem = psutil.virtual_memory()
    return {
        "hostname": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "cpu": {
            "model": _cpu_model(),
            "cores": psutil.cpu_count(logical=False) or os.cpu_count(),
            "threads": os.cpu_count(),
            "usage": psutil.cpu_percent(interval=0.1),
        },
        "memory": {"total": int(mem.total), "available": int(mem.available)},
        "gpus": _gpus(),
    }


PROBE_TIMEOUT_S = 10.0


@ray.remote(num_cpus=0)
def _probe() -> dict[str, Any]:
    return local_hardware()


async def cluster_hardware() -> dict[str, Any]:
    """{"nodes": [...]} with each alive node's own reading and Ray's resources (this
    machine alone when Ray is not running: the in-process app)."""
    if not ray.is_initialized():
        return {"nodes": [{"nodeId": "local", **local_hardware()}]}
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [
        _probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote()
        for n in nodes
    ]
    out = []
    for node, ref in zip(nodes, refs, strict=True):
        try:
            reading = await asyncio.wait_for(ref, PROBE_TIMEOUT_S)
        except Exception as exc:  # a node going away: say so rather than fail the list
            reading = {"error": str(exc)}
        out.append(
            {
                "nodeId": node["NodeID"],
                "address": node.get("NodeManagerAddress"),
                "resources": node.get("Resources", {}),
                **reading,
            }
        )
    return {"nodes": out}
