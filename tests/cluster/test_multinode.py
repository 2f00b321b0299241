"""Model replicas across a head node and a worker node (two raylets on this machine).

Killing the worker node under load: the streams it served end with an error event and
[DONE], the others complete, nothing hangs past 30 s, the head's replica keeps serving,
and when the node comes back Serve puts the lost replica on it again.
"""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.local_cluster import head_and_worker_app, running

MODEL = "smollm2-135m-instruct"
DEPLOYMENT = f"ModelServer:{MODEL}"


@pytest.fixture(scope="module")
def cluster():
    from deployments.builder import build_app
    from deployments.config import AppConfig

    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "models": [
                {
                    "num_replicas": 2,
                    "num_cpus": 1.0,
                    "engine": {"num_threads": 1, "kv_cache_memory_gib": 0.25},
                    # Spread the identical test streams by load alone.
                    "routing": {"prefix_affinity": False},
                }
            ],
        }
    )
    with head_and_worker_app(build_app(config), DEPLOYMENT) as (c, url):
        yield c, url


def replica_nodes(url: str) -> set[str]:
    """The nodes of the live model replicas, from the engine registry."""
    engines = httpx.get(f"{url}/engines", timeout=10).json()["engines"]
    return {e["node_id"] for e in engines if e["engine_name"] == MODEL}


def stream(url: str, started: threading.Event | None = None) -> dict:
    """One streamed chat completion; what it ended with and when."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count slowly from one to one hundred."}],
        "max_tokens": 150,
        "ignore_eos": True,
        "stream": True,
    }
    out = {"done": False, "finish": None, "error": None, "first": False}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                out["error"] = event["error"]
                continue
            if not out["first"]:
                out["first"] = True
                if started is not None:
                    started.set()
            for choice in event["choices"]:
                out["finish"] = choice.get("finish_reason") or out["finish"]
    out["ended"] = time.monotonic()
    return out


def test_killing_the_worker_node_under_load(cluster):
    import ray

    c, url = cluster
    head = ray.get_runtime_context().get_node_id()
    nodes = replica_nodes(url)
    assert len(nodes) == 2 and head in nodes, "one replica per node"

    n = 6
    with ThreadPoolExecutor(n) as pool:
        futures = []
        for _ in range(n):  # one at a time, so that the router sees each one's load
            started = threading.Event()
            futures.append(pool.submit(stream, url, started))
            assert started.wait(timeout=120), "a stream got no first token"
        killed = time.monotonic()
        c.kill_node("worker")
        results = [f.result(timeout=120) for f in futures]

    for r in results:
        assert r["done"], r  # every stream ends with [DONE]
        if r["error"]:  # ... a broken one within 30 s of the kill
            assert r["ended"] - killed < 30, r
            assert set(r["error"]) >= {"message", "type", "code"}, r["error"]
            assert "retry" in r["error"]["message"]
    failed = [r for r in results if r["error"]]
    completed = [r for r in results if r["finish"] == "length" and not r["error"]]
    assert failed, ("the worker's streams end with an error event", results)
    assert completed, ("the head's streams complete", results)
    assert len(failed) + len(completed) == n

    # The head's replica keeps serving while the worker is gone.
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200, r.text

    # The node comes back (as Kubernetes would replace the pod); Serve puts the lost
    # replica on it.
    c.add_node("worker", num_cpus=1, resources={"worker": 1})
    c.wait_for(lambda: running(DEPLOYMENT) == 2 and len(replica_nodes(url)) == 2, 180, "recovery")
    with ThreadPoolExecutor(4) as pool:
        again = list(pool.map(lambda _: stream(url), range(4)))
    assert all(r["done"] and r["finish"] == "length" and not r["error"] for r in again)
