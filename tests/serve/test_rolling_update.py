"""A rolling update: the old replica takes no new requests, lets open streams finish within
graceful_shutdown_timeout_s, and the rest end with a clean error event and [DONE]."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from ray import serve

from tests.serve.live import wait_healthy

MODEL = "smollm2-135m-instruct"
# Streams slow to a few tokens a second while the new replica starts on two cores: the short
# stream needs a grace period with room to spare (24 tokens in 5 s failed on CI).
GRACE_S = 10.0


def config(messages_per_s: float):
    from deployments.config import AppConfig

    return AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "models": [
                {
                    "num_cpus": 0.5,
                    "graceful_shutdown_timeout_s": GRACE_S,
                    "stream_messages_per_s": messages_per_s,
                    "engine": {"num_threads": 1, "kv_cache_memory_gib": 0.25},
                }
            ],
        }
    )


def stream(url: str, max_tokens: int, started: threading.Barrier) -> dict:
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    out = {"done": False, "finish": None, "error": None, "tokens": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
                continue
            if out["tokens"] == 0:
                started.wait(timeout=120)
            out["tokens"] += 1
            out["finish"] = event["choices"][0]["finish_reason"] or out["finish"]
    out["ended"] = time.monotonic()
    return out


def test_rolling_update_drains_then_ends_streams_cleanly(base_url):
    url = f"{base_url}/rolling"
    serve.run(build(100.0), name="rolling", route_prefix="/rolling", blocking=False)
    try:
        wait_healthy(url)
        handle = serve.get_deployment_handle(f"ModelServer:{MODEL}", app_name="rolling")
        old_pid = handle.stats.remote().result()["engine_pid"]
        started = threading.Barrier(3)
        with ThreadPoolExecutor(2) as pool:
            short = pool.submit(stream, url, 8, started)  # finishes within the grace period
            long = pool.submit(stream, url, 4000, started)  # cannot: ends with an error
            started.wait(timeout=180)
            updated = time.monotonic()
            serve.run(build(50.0), name="rolling", route_prefix="/rolling", blocking=False)
            short, long = short.result(timeout=120), long.result(timeout=120)
        assert short["done"] and short["finish"] == "length" and not short["error"], short
        assert long["done"] and long["error"] is not None, long
        assert set(long["error"]) >= {"message", "type", "code"}
        assert "retry" in long["error"]["message"]
        assert long["ended"] - updated < GRACE_S + 20, "ended soon after the grace period"
        wait_healthy(url)
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 3},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert handle.stats.remote().result()["engine_pid"] != old_pid  # a new replica
    finally:
        serve.delete("rolling")


def build(messages_per_s: float):
    from deployments.builder import build_app

    return build_app(config(messages_per_s))
