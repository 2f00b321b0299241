"""The operator on a live Serve app cannot be wedged by models Serve cannot place: more
aliases than the Operator replica's thread pool has threads, each asking for more CPUs
than the cluster has, started at once from the model package (no download); meanwhile
stop, reset, the catalog and a download still answer at once, and the ones left end in
error at model_start_timeout_s with their applications deleted."""

import os
import time

import httpx
import pytest

from tests.fixture_hub import fixture_hub, save_tiny_chat_model
from tests.serve.live import wait_healthy

REPO = "shoal-test/tiny-chat"
# asyncio's default pool in the replica: min(32, CPUs + 4) threads. Two more aliases.
ALIASES = min(32, (os.cpu_count() or 1) + 4) + 2
START_TIMEOUT_S = 90
PROMPT_S = 15  # what "at once" allows on a busy 2-core machine


@pytest.fixture(scope="module")
def wedge(serve_app, tmp_path_factory):
    from ray import serve

    from deployments.builder import build_app
    from deployments.config import AppConfig

    state = tmp_path_factory.mktemp("wedge")
    tiny = save_tiny_chat_model(state / "tiny")
    with fixture_hub() as hub:
        hub.add_directory(REPO, tiny)
        config = AppConfig.model_validate(
            {
                "models": [
                    {
                        "name": "tiny",
                        "num_cpus": 0.25,
                        "engine": {"model": str(tiny), "kv_cache_memory_gib": 0.1},
                    }
                ],
                "embeddings": {"enabled": False},
                "assistants": {"enabled": False},
                "database": {"url": f"sqlite:///{state / 'shoal.sqlite3'}"},
                "operator": {
                    "hub_endpoint": hub.url,
                    "private_hosts": ["127.0.0.1"],
                    "models_dir": str(state / "models"),
                    "model_num_cpus": 64,  # the session's cluster has 8
                    "model_start_timeout_s": START_TIMEOUT_S,
                    "max_runtime_models": ALIASES,
                },
            }
        )
        serve.run(build_app(config), name="wedge", route_prefix="/wedge", blocking=False)
        url = f"{serve_app}/wedge"
        wait_healthy(url)
        yield url
        for name in list(serve.status().applications):
            if name == "wedge" or name.startswith("wedge--"):
                serve.delete(name)


def timed_get(url: str, **params) -> httpx.Response:
    started = time.monotonic()
    r = httpx.get(url, params=params, timeout=PROMPT_S + 30)
    took = time.monotonic() - started
    assert took < PROMPT_S, f"{url} took {took:.1f} s"
    return r


def apps() -> set[str]:
    from ray import serve

    return {n for n in serve.status().applications if n.startswith("wedge--")}


def test_unschedulable_aliases_never_wedge_the_operator(wedge):
    names = [f"stuck-{i}" for i in range(ALIASES)]
    for name in names:
        r = timed_get(f"{wedge}/api/inference/start", alias=name, modelRepo="default")
        assert r.status_code == 200, r.text
    deadline = time.time() + 60
    while len(apps()) < ALIASES:  # every one handed to Serve, none placed
        items = httpx.get(f"{wedge}/api/inference", timeout=30).json()["WingmanItems"]
        assert all(i["status"] == "preparing" for i in items), items
        assert time.time() < deadline, apps()
        time.sleep(0.5)
    statuses = {
        i["alias"]: i["status"] for i in timed_get(f"{wedge}/api/inference").json()["WingmanItems"]
    }
    assert set(statuses.values()) == {"preparing"}, statuses
    # Everything still answers.
    assert timed_get(f"{wedge}/api/models").status_code == 200
    assert timed_get(f"{wedge}/api/downloads/enqueue", modelRepo=REPO).status_code == 200
    stopped = timed_get(f"{wedge}/api/inference/stop", alias=names[0])
    assert stopped.json()["status"] == "complete", stopped.text
    assert timed_get(f"{wedge}/api/inference/reset", alias=names[1]).status_code == 200
    deadline = time.time() + 30
    while {f"wedge--{names[0]}", f"wedge--{names[1]}"} & apps():  # stop deletes the app
        assert time.time() < deadline, apps()
        time.sleep(0.5)
    # The rest fail at the start timeout, their applications taken off.
    deadline = time.time() + START_TIMEOUT_S + 60
    while True:
        items = timed_get(f"{wedge}/api/inference").json()["WingmanItems"]
        left = {i["alias"]: i for i in items if i["alias"] != names[0]}
        if all(i["status"] == "error" for i in left.values()):
            break
        assert time.time() < deadline, left
        time.sleep(1)
    assert all("did not start within" in i["error"] for i in left.values()), left
    assert len(left) == ALIASES - 2
    deadline = time.time() + 60
    while apps():
        assert time.time() < deadline, apps()
        time.sleep(0.5)
    # And the operator still starts and stops what it can.
    assert timed_get(f"{wedge}/api/inference/reset", alias=names[2]).status_code == 200
