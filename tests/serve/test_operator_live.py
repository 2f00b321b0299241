"""The operator API on a live Serve app (its own, at /ops, beside the session's apps):
a model downloaded from a local fixture hub and started under an alias at run time,
chatted with through the OpenAI SDK and the Ollama client while a stream on the
configured model goes on, its events on the WebSocket in order, then stopped; the
cluster's hardware; the page in a real browser; and last, a drain that lets a live
stream finish before the app is deleted."""

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from websockets.sync.client import connect

from tests.fixture_hub import fixture_hub, save_tiny_chat_model
from tests.serve.conftest import APP_PORT
from tests.serve.live import wait_healthy

REPO = "shoal-test/tiny-chat"
ALIAS = "tiny-b"
CHROMIUM = shutil.which("chromium")


@pytest.fixture(scope="module")
def ops(serve_app, tmp_path_factory):
    from ray import serve

    from deployments.builder import build_app
    from deployments.config import AppConfig

    state = tmp_path_factory.mktemp("ops")
    tiny = save_tiny_chat_model(state / "tiny-a")
    with fixture_hub() as hub:
        hub.add_directory(REPO, tiny)
        config = AppConfig.model_validate(
            {
                "models": [
                    {
                        "name": "tiny-a",
                        "num_cpus": 0.5,
                        "engine": {"model": str(tiny), "kv_cache_memory_gib": 0.1},
                    }
                ],
                "embeddings": {"enabled": False},
                # Two ingress replicas: every WebSocket client gets every event, whichever
                # replica it reached. They share one SQLite file (one node here).
                "ingress_replicas": 2,
                "assistants": {"enabled": False},
                "database": {"url": f"sqlite:///{state / 'shoal.sqlite3'}"},
                "operator": {
                    "hub_endpoint": hub.url,
                    "private_hosts": ["127.0.0.1"],
                    "models_dir": str(state / "models"),
                    "model_num_cpus": 0.5,
                    "drain_timeout_s": 60,
                },
            }
        )
        serve.run(build_app(config), name="ops", route_prefix="/ops", blocking=False)
        url = f"{serve_app}/ops"
        wait_healthy(url)
        yield url
        if "ops" in serve.status().applications:
            serve.delete("ops")
        for name in list(serve.status().applications):
            if name.startswith("ops--"):
                serve.delete(name)


def events(url: str, into: list, stop: threading.Event) -> None:
    ws_url = url.replace("http://", "ws://") + "/ws"
    with connect(ws_url, open_timeout=10) as ws:
        while not stop.is_set():
            try:
                into.append(json.loads(ws.recv(timeout=0.5)))
            except TimeoutError:
                continue


def wait_status(url: str, alias: str, status: str, timeout_s: float = 240) -> dict:
    deadline = time.time() + timeout_s
    while True:
        items = httpx.get(f"{url}/api/inference/status", params={"alias": alias}).json()
        if items and items[0]["status"] == status:
            return items[0]
        assert items and items[0]["status"] != "error", items
        assert time.time() < deadline, items
        time.sleep(0.5)


WATCHERS = 4  # WebSocket clients, spread by Serve's proxy over the ingress replicas


def test_start_an_alias_at_run_time_beside_a_live_stream(ops):
    seen_by: list[list] = [[] for _ in range(WATCHERS)]
    stop = threading.Event()
    watchers = [
        threading.Thread(target=events, args=(ops, seen, stop), daemon=True) for seen in seen_by
    ]
    for watcher in watchers:
        watcher.start()
    time.sleep(1.0)
    client = openai.OpenAI(base_url=f"{ops}/v1", api_key="none", max_retries=0)
    try:
        assert (
            httpx.get(f"{ops}/api/downloads/enqueue", params={"modelRepo": REPO}).status_code == 200
        )
        deadline = time.time() + 60
        while httpx.get(f"{ops}/api/downloads").json()["DownloadItems"][0]["status"] != "complete":
            assert time.time() < deadline
            time.sleep(0.3)
        # A stream on the configured model goes on while the alias starts and stops.
        long = client.chat.completions.create(
            model="tiny-a",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1500,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = next(iter(long))
        assert first.choices
        r = httpx.get(
            f"{ops}/api/inference/start", params={"alias": ALIAS, "modelRepo": REPO}, timeout=30
        )
        assert r.status_code == 200 and r.json()["status"] in ("queued", "preparing"), r.text
        wait_status(ops, ALIAS, "inferring")
        deadline = time.time() + 30
        while ALIAS not in [m.id for m in client.models.list().data]:
            assert time.time() < deadline
            time.sleep(0.3)
        reply = client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
        assert reply.model == ALIAS and reply.usage.completion_tokens > 0
        chat = ollama.Client(host=ops).chat(
            model=ALIAS, messages=[{"role": "user", "content": "hello"}], options={"num_predict": 8}
        )
        assert chat.message.role == "assistant" and chat.eval_count > 0
        ps = [m.model for m in ollama.Client(host=ops).ps().models]
        assert f"{ALIAS}:latest" in ps
        stopped = httpx.get(f"{ops}/api/inference/stop", params={"alias": ALIAS}, timeout=120)
        assert stopped.json()["status"] == "complete"
        # The first model's stream was never interrupted.
        tokens = 1 + sum(1 for c in long if c.choices and c.choices[0].delta.content is not None)
        assert tokens > 100
        deadline = time.time() + 30
        while ALIAS in [m.id for m in client.models.list().data]:
            assert time.time() < deadline
            time.sleep(0.3)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model=ALIAS, messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
    finally:
        stop.set()
        for watcher in watchers:
            watcher.join(timeout=5)
    for seen in seen_by:
        statuses = [
            e["data"]["status"]
            for e in seen
            if e["event"] == "inference_status" and e["data"]["alias"] == ALIAS
        ]
        assert statuses == ["queued", "preparing", "inferring", "cancelling", "complete"]
        assert any(e["event"] == "metrics" and e["data"]["alias"] == "tiny-a" for e in seen)
        downloads = [e["data"]["status"] for e in seen if e["event"] == "download_status"]
        assert downloads[0] == "queued" and downloads[-1] == "complete"


def test_errors_and_hardware(ops):
    r = httpx.get(f"{ops}/api/inference/start", params={"alias": "x", "modelRepo": "no/such"})
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{ops}/api/inference/start", params={"alias": "tiny-a", "modelRepo": REPO})
    assert r.status_code == 409
    nodes = httpx.get(f"{ops}/api/hardware", timeout=30).json()["nodes"]
    assert nodes and nodes[0]["memory"]["total"] > 0 and nodes[0]["cpu"]["threads"] >= 1
    assert httpx.get(f"{ops}/api/hardwareinfo", timeout=30).status_code == 200


def test_ollama_pull_runs_and_delete_removes(ops):
    client = ollama.Client(host=ops, timeout=300)
    statuses = [p.status for p in client.pull(REPO, stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
    assert "loading model" in statuses
    assert f"{REPO}:latest" in [m.model for m in client.ps().models]
    reply = client.generate(model=REPO, prompt="hello", options={"num_predict": 4})
    assert reply.eval_count > 0
    client.delete(REPO)
    assert f"{REPO}:latest" not in [m.model for m in client.ps().models]
    assert httpx.get(f"{ops}/api/downloads", params={"modelRepo": REPO}).json() == {
        "DownloadItems": []
    }
    with pytest.raises(ollama.ResponseError) as missing:
        client.delete(REPO)
    assert missing.value.status_code == 404


def alias_replicas(url: str, alias: str, timeout_s: float = 30) -> set[str]:
    deadline = time.time() + timeout_s
    while True:
        engines = httpx.get(f"{url}/engines").json()["engines"]
        ids = {e["engine_id"] for e in engines if e["engine_name"] == alias}
        if ids:
            return ids
        assert time.time() < deadline, engines
        time.sleep(0.5)


def test_a_restarted_operator_serves_its_aliases_again(ops):
    """The operator's replica dies: its successor reads the aliases from the database,
    finds the alias's application still running and serves it again, unrestarted."""
    import ray

    assert httpx.get(f"{ops}/api/downloads/enqueue", params={"modelRepo": REPO}).status_code == 200
    deadline = time.time() + 60
    while (
        httpx.get(f"{ops}/api/downloads", params={"filePath": ""}).json()["DownloadItems"][0][
            "status"
        ]
        != "complete"
    ):
        assert time.time() < deadline
        time.sleep(0.3)
    httpx.get(f"{ops}/api/inference/start", params={"alias": "tiny-c", "modelRepo": REPO})
    before = wait_status(ops, "tiny-c", "inferring")
    replicas = alias_replicas(ops, "tiny-c")
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::ops#Operator#")
    ]
    assert len(names) == 1
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    deadline = time.time() + 120
    while True:  # a new replica answers (the old one's items are read again)
        try:
            items = httpx.get(f"{ops}/api/inference/status", timeout=5).json()
            if isinstance(items, list) and items:
                break
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "no new operator"
        time.sleep(0.5)
    after = wait_status(ops, "tiny-c", "inferring")
    assert after["created"] == before["created"]
    assert alias_replicas(ops, "tiny-c") == replicas  # the same replica: not redeployed
    client = openai.OpenAI(base_url=f"{ops}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model="tiny-c", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.usage.completion_tokens > 0
    assert (
        httpx.get(f"{ops}/api/inference/reset", params={"alias": "tiny-c"}, timeout=120).json()[
            "status"
        ]
        == "complete"
    )


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_the_page_in_a_real_browser(ops, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(f"{ops}/ui")
            page.wait_for_selector("#model option[value='tiny-a']", state="attached")
            page.wait_for_selector("#conn.on", timeout=15000)
            page.fill("#prompt", "Hello there")
            page.click("#send")
            page.wait_for_function(
                "document.querySelector('.msg.assistant')?.textContent.length > 5", timeout=60000
            )
            page.wait_for_selector("#engines tbody tr", timeout=15000)
            page.wait_for_function(  # three samples of /metrics, two seconds apart
                "Number(document.querySelector('#chart').dataset.points) >= 3", timeout=30000
            )
            shot = Path(tmp_path) / "page.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            print(f"screenshot: {shot}")
            assert "error" not in page.inner_text("#log").lower()
        finally:
            browser.close()


def test_shutdown_drains_a_live_stream(ops):
    """Last in the module: the app is gone afterwards."""
    from ray import serve

    client = openai.OpenAI(base_url=f"{ops}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="tiny-a",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=300,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    assert httpx.get(f"{ops}/api/shutdown").json()["status"] == "draining"
    deadline = time.time() + 10
    while httpx.get(f"{ops}/v1/models").status_code != 503:
        assert time.time() < deadline
        time.sleep(0.2)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length"
    deadline = time.time() + 90
    while "ops" in serve.status().applications:
        assert time.time() < deadline, "the drained app was not deleted"
        time.sleep(0.5)
    assert httpx.get(f"http://127.0.0.1:{APP_PORT}/health").status_code == 200  # others stay
