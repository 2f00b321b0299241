"""The app under Ray Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1): the Ingress
replica answers HTTP on its own port, with no proxy between it and the client, and the
proxy's port still works. README ("Direct ingress") documents the mode; this checks what
Shoal itself must keep true there: the same greedy text on both paths through the official
OpenAI client, errors in OpenAI's shape, and a client that hangs up freeing its request.

Its own Ray (a `ray start` head with the flags in its environment, tests/direct_ingress.py):
the flags are read when Serve's controller and replicas start, so the session's shared app
cannot have them.
"""

import contextlib
import time

import httpx
import pytest

from tests.direct_ingress import direct_ingress_flags, find_direct_ingress
from tests.local_cluster import LocalCluster, free_port, healthy

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def urls():
    import ray
    from ray import serve

    from deployments.builder import build_app
    from deployments.config import AppConfig

    first = free_port()
    c = LocalCluster()
    try:
        c.start_head(num_cpus=2, env=direct_ingress_flags(first))
        ray.init(address=c.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = AppConfig.model_validate(
            {
                "embeddings": {"enabled": False},
                "models": [{"engine": {"num_threads": 1, "kv_cache_memory_gib": 0.25}}],
            }
        )
        serve.run(build_app(config), name="default", route_prefix="/")
        proxy = f"http://127.0.0.1:{port}"
        c.wait_for(lambda: healthy(proxy), 120, "the proxy's /health")
        yield proxy, find_direct_ingress(first, skip=port)
    finally:
        try:
            # Only on this cluster: serve.shutdown() with no Ray would start one of its own.
            if ray.is_initialized():
                with contextlib.suppress(Exception):
                    serve.shutdown()
            ray.shutdown()
        finally:
            c.stop()


def test_both_paths_stream_the_same_text(urls):
    from openai import OpenAI

    texts = []
    for url in urls:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stream=True
        )
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    assert texts[0] and texts[0] == texts[1]


def test_errors_keep_openai_shape(urls):
    _, direct = urls
    r = httpx.post(
        f"{direct}/v1/chat/completions",
        json={"model": MODEL, "messages": CHAT, "max_tokens": 0},
        timeout=30,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{direct}/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code in (400, 422) and "error" in r.json()


def test_hanging_up_frees_the_request(urls):
    from ray import serve

    _, direct = urls
    # 4000 tokens on one CPU thread take minutes, far past the 20 s below: only the
    # hang-up can end the request in time.
    body = {
        "model": MODEL,
        "prompt": "Write a long story.",
        "max_tokens": 4000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{direct}/v1/completions", json=body, timeout=60) as r:
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data:")
            if lines >= 3:
                break
    handle = serve.get_deployment_handle(f"ModelServer:{MODEL}", app_name="default")
    deadline = time.time() + 20
    while time.time() < deadline:
        stats = handle.stats.remote().result(timeout_s=10)
        if stats["num_running"] == 0 and stats["kv_blocks_used"] == 0:
            break
        time.sleep(0.2)
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0
