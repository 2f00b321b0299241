"""Horizontal scale on this machine: replicas, failures, prefix-affinity routing.

Parts (all by default; pick with --parts):
- throughput: the app with 1 and then 2 model replicas (engine threads split between
  them), N closed-loop clients streaming chat for a fixed time: output tokens/s and
  p50/p99 TTFT.
- replica-kill: 2 replicas under load; one replica actor is killed (ray.kill): failed
  streams, and the time until Serve has 2 running replicas again.
- node-kill: a head node and a worker node (tests/local_cluster.py), one replica each,
  under load; the worker's raylet is SIGKILLed, then the node restarted: failed
  streams, the longest a stream took to end after the kill, the time until a request
  sent after the kill succeeded, and the time from the restart until 2 replicas run.
- autoscale: min 1, max 2 replicas, target 4 ongoing requests per replica; 16 clients
  for 90 s: when the second replica started running, then tokens/s before and after.
- prefix: 2 replicas, chat requests drawn from 24 long system prompts, with the router's
  prefix affinity on and off, with a large and a small KV cache: the prefix-cache hit
  ratio (cached prompt tokens / prompt tokens, from usage.prompt_tokens_details) and
  TTFT.

Every figure comes from this machine in this run; the last line printed is JSON.
"""

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import QUESTIONS, Load, chat_body, closed_loop, mixed  # noqa: E402
from tests.local_cluster import free_port, head_and_worker_app, running  # noqa: E402

MODEL = "smollm2-135m-instruct"


def app_config(replicas: int, threads: int, engine: dict | None = None, **model):
    from deployments.config import AppConfig

    engine = {"num_threads": threads, **(engine or {})}
    model = {"num_replicas": replicas, "num_cpus": 1.0, "engine": engine, **model}
    return AppConfig.model_validate({"embeddings": {"enabled": False}, "models": [model]})


def deploy(config, url: str) -> None:
    from ray import serve

    from deployments.builder import build_app

    serve.run(build_app(config), name="default", route_prefix="/", blocking=False)
    deadline = time.time() + 300
    while time.time() < deadline:
        if running_replicas() == config.models[0].num_replicas:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise TimeoutError("the app did not start")


def running_replicas() -> int:
    return running(f"ModelServer:{MODEL}")


def model_replica_names() -> list[str]:
    """Named actors of the model's replicas (from the GCS; no dashboard needed)."""
    import ray

    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::default#ModelServer")
    ]


def watch_recovery(since: float, target: int, result: dict, key: str) -> threading.Thread:
    """Record in result[key] the seconds from `since` until `target` replicas run again,
    after Serve has first seen fewer (a kill takes a moment to notice)."""

    def watch() -> None:
        deadline = since + 300
        while running_replicas() >= target and time.monotonic() < since + 60:
            time.sleep(0.1)
        while running_replicas() < target:
            if time.monotonic() > deadline:
                return
            time.sleep(0.25)
        result[key] = round(time.monotonic() - since, 1)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def part_throughput(url: str, args) -> dict:
    out = {}
    for replicas in (1, 2):
        deploy(app_config(replicas, max(1, 2 // replicas)), url)
        asyncio.run(closed_loop(url, 2, 5, mixed(16), Load()))  # warm-up
        load = Load()
        asyncio.run(closed_loop(url, args.clients, args.seconds, mixed(64), load))
        out[f"replicas_{replicas}"] = load.summary(args.seconds)
        print(f"throughput, {replicas} replica(s):", out[f"replicas_{replicas}"], flush=True)
    return out


def part_replica_kill(url: str, args) -> dict:
    import ray

    deploy(app_config(2, 1), url)
    load, result = Load(), {}

    async def run() -> None:
        task = asyncio.create_task(closed_loop(url, args.clients, 60, mixed(64), load))
        await asyncio.sleep(15)
        victim = model_replica_names()[0]
        result["killed_at"] = time.monotonic()
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        watch_recovery(result["killed_at"], 2, result, "recovered_s")
        await task

    asyncio.run(run())
    killed = result.pop("killed_at")
    failed = [o for o in load.outcomes if o.error]
    result.update(load.summary(60))
    result["failed_streams"] = len(failed)
    result["failures_after_kill_s"] = round(max((o.ended - killed for o in failed), default=0), 1)
    print("replica kill:", result, flush=True)
    return result


def part_node_kill(args) -> dict:
    from deployments.builder import build_app

    result: dict = {}
    config = app_config(2, 1, engine={"kv_cache_memory_gib": 0.25})
    with head_and_worker_app(build_app(config), f"ModelServer:{MODEL}") as (c, url):
        load = Load()

        async def run() -> None:
            task = asyncio.create_task(closed_loop(url, args.clients, 75, mixed(64), load))
            await asyncio.sleep(15)
            result["killed_at"] = time.monotonic()
            await asyncio.to_thread(c.kill_node, "worker")
            await asyncio.sleep(15)
            result["restarted_at"] = time.monotonic()
            await asyncio.to_thread(c.add_node, "worker", 1, {"worker": 1})
            watch_recovery(result["restarted_at"], 2, result, "recovered_after_restart_s")
            await task

        asyncio.run(run())
        killed = result.pop("killed_at")
        result.pop("restarted_at")
        failed = [o for o in load.outcomes if o.error]
        hit = [o for o in load.outcomes if o.sent <= killed <= o.ended]
        first_ok = min(
            (o.ended for o in load.outcomes if o.sent > killed and not o.error), default=None
        )
        result.update(load.summary(75))
        result["streams_open_at_kill"] = len(hit)
        result["failed_streams"] = len(failed)
        result["longest_end_after_kill_s"] = round(
            max((o.ended - killed for o in hit), default=0), 1
        )
        result["first_success_after_kill_s"] = round(first_ok - killed, 1) if first_ok else None
        print("node kill:", result, flush=True)
    return result


def part_autoscale(url: str, args) -> dict:
    auto = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 4}
    auto |= {"upscale_delay_s": 5, "downscale_delay_s": 600, "look_back_period_s": 10}
    deploy(app_config(1, 1, autoscaling=auto), url)
    load, result = Load(), {}
    start = time.monotonic()
    watch_recovery(start, 2, result, "second_replica_running_after_s")
    asyncio.run(closed_loop(url, args.clients, 90, mixed(64), load))
    up = result.get("second_replica_running_after_s")
    if up is not None:
        before = load.window(start, start + up)
        after = load.window(start + up + 5, start + 90)
        result["tok_s_before"] = round(sum(o.tokens for o in before) / up, 1)
        result["tok_s_after"] = round(sum(o.tokens for o in after) / (85 - up), 1)
    result.update(load.summary(90))
    print("autoscale:", result, flush=True)
    return result


def part_prefix(url: str, args) -> dict:
    systems = [
        f"You are assistant number {i}. "
        + f"Your speciality is topic {i}; you answer briefly and precisely about it. " * 14
        for i in range(24)
    ]
    out = {}
    for cache_gib in (1.0, 0.12):
        for affinity in (True, False):
            model = {"routing": {"prefix_affinity": affinity}}
            deploy(app_config(2, 1, engine={"kv_cache_memory_gib": cache_gib}, **model), url)
            load = Load()
            make = lambda rng: chat_body(rng.choice(systems), rng.choice(QUESTIONS), 4)  # noqa: E731
            asyncio.run(closed_loop(url, 4, args.seconds, make, load))
            ok = [o for o in load.outcomes if not o.error]
            key = f"kv_{cache_gib}gib_affinity_{'on' if affinity else 'off'}"
            out[key] = {
                "hit_ratio": round(
                    sum(o.cached for o in ok) / max(1, sum(o.prompt for o in ok)), 3
                ),
                **load.summary(args.seconds),
            }
            print("prefix:", key, out[key], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="throughput,replica-kill,autoscale,prefix,node-kill")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=40)
    args = parser.parse_args()
    parts = args.parts.split(",")
    results: dict = {}
    local = [p for p in parts if p != "node-kill"]
    if local:
        import ray
        from ray import serve

        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            if "throughput" in parts:
                results["throughput"] = part_throughput(url, args)
            if "replica-kill" in parts:
                results["replica_kill"] = part_replica_kill(url, args)
            if "autoscale" in parts:
                results["autoscale"] = part_autoscale(url, args)
            if "prefix" in parts:
                results["prefix"] = part_prefix(url, args)
        finally:
            serve.shutdown()
            ray.shutdown()
    if "node-kill" in parts:
        results["node_kill"] = part_node_kill(args)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
