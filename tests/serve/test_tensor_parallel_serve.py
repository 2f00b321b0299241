"""A TP=3 SmolLM2 replica (configs/tp.yaml) through Serve: answers over the OpenAI API;
killing one shard actor gives a clean error event, and Serve brings the replica back."""

import json
import time
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from deployments.shard_actor import SHARD_NAMESPACE

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tp_url(base_url):
    from deployments.builder import build_app
    from deployments.config import AppConfig

    config = AppConfig.from_yaml(ROOT / "configs" / "tp.yaml")
    config = config.model_copy(
        update={"embeddings": config.embeddings.model_copy(update={"enabled": False})}
    )
    serve.run(build_app(config), name="tp", route_prefix="/tp", blocking=False)
    wait_for_answer(f"{base_url}/tp", 300)
    yield f"{base_url}/tp"
    serve.delete("tp")


def wait_for_answer(url: str, timeout_s: float) -> httpx.Response:
    deadline = time.time() + timeout_s
    while True:
        try:
            r = httpx.post(
                f"{url}/v1/completions",
                json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                timeout=60,
            )
            if r.status_code == 200:
                return r
            assert r.status_code in (404, 503), r.text  # not deployed yet, or recovering
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "the TP app did not answer in time"
        time.sleep(1)


def replica_stats() -> dict:
    handle = serve.get_deployment_handle(f"ModelServer:{MODEL}", app_name="tp")
    return handle.stats.remote().result(timeout_s=30)


def test_chat_from_a_tp3_replica(tp_url):
    from openai import OpenAI

    client = OpenAI(base_url=f"{tp_url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=8,
        temperature=0,
    )
    assert out.choices[0].message.content and out.usage.completion_tokens > 0
    stats = replica_stats()
    assert stats["tensor_parallel_size"] == 3 and len(stats["shards"]) == 2


def test_killing_a_shard_gives_an_error_event_and_the_replica_comes_back(tp_url):
    before = replica_stats()
    victim = ray.get_actor(before["shards"][0], namespace=SHARD_NAMESPACE)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    events = []
    with httpx.stream("POST", f"{tp_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    ray.kill(victim)
                    killed = time.monotonic()
    assert time.monotonic() - killed < 10  # the stream ended promptly
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2])
    wait_for_answer(tp_url, 180)
    assert replica_stats()["shards"] != before["shards"]  # a whole new replica
