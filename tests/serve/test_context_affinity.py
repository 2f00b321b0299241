"""With two replicas behind two ingress replicas, every primitive on a context reaches the
replica that holds it, whichever ingress it comes through (deployments/routing_state.py)."""

import time
from pathlib import Path

import httpx
import pytest
from ray import serve

MODEL = "smollm2-135m-instruct"


def pair_app(database: Path, model_replicas: int):  # noqa: ANN201 (a Serve Application)
    from deployments.builder import build_app
    from deployments.config import AppConfig

    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            # Two ingress replicas: the HTTP proxy spreads calls over both, so a context
            # is used through the one that did not create it about half the time.
            "ingress_replicas": 2,
            "database": {"url": f"sqlite:///{database}"},
            "models": [
                {"num_replicas": model_replicas, "num_cpus": 0.5, "engine": {"num_threads": 1}}
            ],
        }
    )
    return build_app(config)


@pytest.fixture(scope="module")
def database(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pair") / "shoal.db"


@pytest.fixture(scope="module")
def pair_url(base_url, database):
    serve.run(pair_app(database, 2), name="pair", route_prefix="/pair", blocking=False)
    deadline = time.time() + 300
    while httpx.get(f"{base_url}/pair/health", timeout=30).status_code != 200:
        assert time.time() < deadline, "the two-replica app did not start"
        time.sleep(1)
    yield f"{base_url}/pair"
    serve.delete("pair")


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def test_every_primitive_reaches_the_holder(pair_url):
    greedy = {"temperature": 0, "max_gen_length": 4}
    contexts = [5000 + i for i in range(8)]  # Parrot ids are integers
    for i, cid in enumerate(contexts):
        r = post(
            pair_url,
            "/fill",
            {"session_id": 1, "task_id": i, "context_id": cid, "text": f"Item {i}:"},
        )
        assert r.status_code == 200, r.text
    for _ in range(2):  # each Generate and Fill must find its context (else 404)
        for i, cid in enumerate(contexts):
            ids = {"session_id": 1, "task_id": 100 + i, "context_id": cid}
            r = post(pair_url, "/generate", {**ids, "sampling_config": greedy})
            assert r.status_code == 200, r.text
            r = post(pair_url, "/fill", {**ids, "text": " and more"})
            assert r.status_code == 200, r.text
    children = [6000 + i for i in range(4)]
    for i, name in enumerate(children):  # a new child is made where its parent lives
        child = {"session_id": 1, "task_id": 900 + i, "context_id": name}
        child["parent_context_id"] = contexts[i]
        r = post(pair_url, "/generate", {**child, "sampling_config": greedy})
        assert r.status_code == 200, r.text
    # Both replicas hold some of them (the router spread the new contexts).
    handle = serve.get_deployment_handle(f"ModelServer:{MODEL}", app_name="pair")
    held = {}
    for _ in range(20):
        stats = handle.stats.remote().result(timeout_s=30)
        held[stats["replica"]] = stats["num_contexts"]
    assert len(held) == 2 and sum(held.values()) == len(contexts) + len(children)
    for cid in [*contexts, *children]:
        assert post(pair_url, "/free_context", {"context_id": cid}).status_code == 200


def ingress_replicas(app: str) -> list[str]:
    import ray

    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#Ingress#")
    ]


def test_contexts_are_found_through_an_ingress_that_replaced_a_killed_one(pair_url):
    """An ingress replica that is killed and replaced starts with no pins of its own:
    it finds the contexts in the shared routing state."""
    import ray

    greedy = {"temperature": 0, "max_gen_length": 2}
    contexts = [8000 + i for i in range(8)]
    for i, cid in enumerate(contexts):
        ids = {"session_id": 4, "task_id": i, "context_id": cid}
        assert post(pair_url, "/fill", {**ids, "text": f"Note {i}:"}).status_code == 200
    before = ingress_replicas("pair")
    assert len(before) == 2
    ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
    deadline = time.time() + 120
    while True:  # Serve starts a replacement; wait until both answer again
        now = ingress_replicas("pair")
        status = serve.status().applications["pair"].deployments["Ingress"]
        if before[0] not in now and status.replica_states.get("RUNNING") == 2:
            break
        assert time.time() < deadline, status
        time.sleep(1)
    for _ in range(3):  # about half of these go through the new replica
        for i, cid in enumerate(contexts):
            ids = {"session_id": 4, "task_id": 50 + i, "context_id": cid}
            r = post(pair_url, "/generate", {**ids, "sampling_config": greedy})
            assert r.status_code == 200, r.text
    for cid in contexts:
        assert post(pair_url, "/free_context", {"context_id": cid}).status_code == 200


TOPICS = ["volcanoes", "sailing", "chess", "bread", "comets", "bees"]


def system_prompt(topic: str) -> str:
    return (
        f"You are a patient tutor who only talks about {topic}. "
        + f"Everything you say concerns {topic}, its history and its practice. " * 6
    )


def test_shared_prefixes_reach_the_replica_that_cached_them(pair_url):
    """Each system prompt's later requests land where its first one ran, so they find it
    in that replica's prefix cache (reported as usage.prompt_tokens_details)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{pair_url}/v1", api_key="unused", max_retries=0, timeout=120)
    cached: dict[str, list[int]] = {t: [] for t in TOPICS}
    prompt_tokens: dict[str, int] = {}
    for question in ["What is it?", "Tell me one fact.", "Why does it matter?"]:
        for topic in TOPICS:
            r = client.chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "system", "content": system_prompt(topic)},
                    {"role": "user", "content": question},
                ],
                max_tokens=1,
            )
            cached[topic].append(r.usage.prompt_tokens_details.cached_tokens)
            prompt_tokens[topic] = r.usage.prompt_tokens
    for topic, hits in cached.items():
        assert prompt_tokens[topic] > 100
        # The system prompt is over 90 tokens: every repeat finds at least that much cached.
        assert all(h >= 80 for h in hits[1:]), (topic, hits)


def contexts_held(pair_url: str) -> dict[str, int]:
    return per_replica("num_contexts")


def per_replica(figure: str) -> dict[str, int]:
    """One of the model replicas' figures, by replica (asked until both answered)."""
    handle = serve.get_deployment_handle(f"ModelServer:{MODEL}", app_name="pair")
    seen: dict[str, int] = {}
    for _ in range(40):
        stats = handle.stats.remote().result(timeout_s=30)
        seen[stats["replica"]] = stats[figure]
    return seen


def test_concurrent_calls_creating_one_context_create_it_once(pair_url):
    """The pin is taken when the first call is routed, before it is sent: the others follow
    it (and wait for, or are refused by, the busy context) instead of creating a second
    copy on the other replica, where it would leak."""
    import asyncio

    before = sum(contexts_held(pair_url).values())
    new = [7000 + k for k in range(6)]

    async def fill(client: httpx.AsyncClient, cid: int, task: int) -> int:
        body = {"session_id": 3, "task_id": task, "context_id": cid, "text": "Same time"}
        return (await client.post(f"{pair_url}/fill", json=body)).status_code

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(fill(client, c, j) for c in new for j in range(6)))

    statuses = asyncio.run(burst())
    assert set(statuses) <= {200, 409}, statuses
    held = contexts_held(pair_url)
    assert sum(held.values()) - before == len(new), held
    for cid in new:
        assert post(pair_url, "/free_context", {"context_id": cid}).status_code == 200


def test_a_replica_whose_engine_died_gets_no_more_traffic(pair_url):
    """It leaves at once (rather than failing three health checks while answering every
    request with an error), and requests that had not started go to the other replica."""
    import asyncio
    import os
    import signal

    handle = serve.get_deployment_handle(f"ModelServer:{MODEL}", app_name="pair")
    pids: dict[str, int] = {}
    for _ in range(30):
        stats = handle.stats.remote().result(timeout_s=30)
        pids[stats["replica"]] = stats["engine_pid"]
    assert len(pids) == 2
    os.kill(next(iter(pids.values())), signal.SIGKILL)
    time.sleep(0.2)  # requests inside the engine when it died end with an error event
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

    async def one(client: httpx.AsyncClient, i: int) -> int:
        await asyncio.sleep(0.05 * i)
        return (await client.post(f"{pair_url}/v1/chat/completions", json=body)).status_code

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(30)))

    statuses = asyncio.run(burst())
    assert statuses == [200] * 30, statuses


def test_an_operator_moves_contexts_and_evens_them_out(pair_url):
    """/api/inference/move sends a live context to the other replica: its next Generate
    computes only its new tokens and says what an unmoved context says. With all six on
    one replica, /api/inference/rebalance moves three to the other."""
    import ray

    wait_for_model_replicas(pair_url, 2)
    from deployments.routing_state import actor_name

    routing = ray.get_actor(actor_name("pair"), namespace="shoal")
    where = lambda cid: ray.get(routing.where.remote(f"ModelServer:{MODEL}", str(cid)))  # noqa: E731
    greedy = {"temperature": 0, "max_gen_length": 4}
    story = "Log {}: the night ferry left the harbour with its lamps lit and its deck empty"
    contexts = [9700 + i for i in range(6)]
    for i, cid in enumerate(contexts):
        ids = {"session_id": 6, "task_id": i, "context_id": cid}
        assert post(pair_url, "/fill", {**ids, "text": story.format(i)}).status_code == 200
    homes = {cid: where(cid) for cid in contexts}
    engines = httpx.get(f"{pair_url}/engines", timeout=30).json()
    replicas = sorted({e["engine_id"] for e in engines["engines"]})
    assert len(replicas) == 2 and set(homes.values()) <= set(replicas), (homes, engines)
    first = replicas[0]

    def operator(path: str, **params: object) -> httpx.Response:
        return httpx.post(f"{pair_url}/api/inference/{path}", params=params, timeout=120)

    before = prompt_tokens(pair_url)
    for cid in contexts:  # all onto the first replica
        if homes[cid] != first:
            r = operator("move", alias=MODEL, context_id=str(cid), to=first)
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] > 10
        assert where(cid) == first
    texts = []
    for i, cid in enumerate(contexts):
        ids = {"session_id": 6, "task_id": 100 + i, "context_id": cid}
        r = post(pair_url, "/generate", {**ids, "sampling_config": greedy})
        assert r.status_code == 200, r.text
        texts.append(r.json()["generated_text"])
    computed = sum(prompt_tokens(pair_url).values()) - sum(before.values())
    assert computed <= 2 * len(contexts), computed  # not their histories again

    r = operator("rebalance", alias=MODEL)
    assert r.status_code == 200, r.text
    moved = r.json()["moved"]
    assert len(moved) == 3 and r.json()["skipped"] == [], r.json()
    assert {m["from"] for m in moved} == {first} and {m["to"] for m in moved} == {replicas[1]}
    assert sorted(where(cid) for cid in contexts) == sorted(replicas * 3)
    before = prompt_tokens(pair_url)
    for i, cid in enumerate(contexts):
        ids = {"session_id": 6, "task_id": 300 + i, "context_id": cid}
        r = post(pair_url, "/generate", {**ids, "sampling_config": greedy})
        assert r.status_code == 200, r.text
    computed = sum(prompt_tokens(pair_url).values()) - sum(before.values())
    assert computed <= 2 * len(contexts), computed
    for i in range(len(contexts)):  # each said what one never moved says
        ids = {"session_id": 6, "task_id": 200 + i, "context_id": 9800 + i}
        assert post(pair_url, "/fill", {**ids, "text": story.format(i)}).status_code == 200
        r = post(pair_url, "/generate", {**ids, "sampling_config": greedy})
        assert r.json()["generated_text"] == texts[i], i
    for cid in [*contexts, *range(9800, 9806)]:
        assert post(pair_url, "/free_context", {"context_id": cid}).status_code == 200
    assert operator("move", alias=MODEL, context_id="nope", to=first).status_code == 404
    assert operator("move", alias=MODEL, context_id="9700", to="r9").status_code == 400
    assert operator("rebalance", alias="no-such-model").status_code == 404


def wait_for_model_replicas(pair_url: str, n: int) -> None:
    """Until Serve runs n replicas and the registry lists those and no other (a replica
    killed by an earlier test stays listed until its heartbeats go stale)."""
    deadline = time.time() + 300
    while True:
        status = serve.status().applications["pair"]
        replicas = status.deployments[f"ModelServer:{MODEL}"].replica_states
        engines = httpx.get(f"{pair_url}/engines", timeout=30).json()
        listed = {e["engine_id"] for e in engines["engines"]}
        if (
            replicas == {"RUNNING": n}
            and len(listed) == n
            and listed == set(contexts_held(pair_url))
        ):
            return
        assert time.time() < deadline, (status, engines)
        time.sleep(1)


def prompt_tokens(pair_url: str) -> dict[str, int]:
    """Prompt tokens computed so far by each model replica."""
    return per_replica("num_prompt_tokens")


def test_contexts_move_when_their_replica_is_drained(pair_url, database):
    """20 contexts on two replicas; the app is redeployed with one. The drained replica's
    contexts are parked in the object store (deployments/context_moves.py) and restored
    where their next call lands: each Generate computes only its last token, and says
    what a context built from scratch there says. (Last here: it leaves one replica.)"""
    greedy = {"temperature": 0, "max_gen_length": 6}
    story = "Story {}: a lighthouse keeper named Ada counted the ships that passed each night"
    contexts = [9000 + i for i in range(20)]
    for i, cid in enumerate(contexts):
        ids = {"session_id": 5, "task_id": i, "context_id": cid}
        assert post(pair_url, "/fill", {**ids, "text": story.format(i)}).status_code == 200
    assert all(n > 0 for n in contexts_held(pair_url).values())  # both hold some
    serve.run(pair_app(database, 1), name="pair", route_prefix="/pair", blocking=False)
    handle = serve.get_deployment_handle(f"ModelServer:{MODEL}", app_name="pair")
    deadline = time.time() + 300
    while True:
        status = serve.status().applications["pair"]
        replicas = status.deployments[f"ModelServer:{MODEL}"].replica_states
        if status.status == "RUNNING" and replicas == {"RUNNING": 1}:
            break
        assert time.time() < deadline, status
        time.sleep(1)
    before = handle.stats.remote().result(timeout_s=30)
    texts = []
    for i, cid in enumerate(contexts):
        ids = {"session_id": 5, "task_id": 100 + i, "context_id": cid}
        r = post(pair_url, "/generate", {**ids, "sampling_config": greedy})
        assert r.status_code == 200, r.text
        texts.append(r.json()["generated_text"])
    after = handle.stats.remote().result(timeout_s=30)
    assert after["num_contexts"] >= len(contexts)
    computed = after["num_prompt_tokens"] - before["num_prompt_tokens"]
    assert computed <= 2 * len(contexts), computed  # not their ~20-token histories
    for i, text in enumerate(texts):  # the same words as a context that never moved
        ids = {"session_id": 5, "task_id": 200 + i, "context_id": 9500 + i}
        assert post(pair_url, "/fill", {**ids, "text": story.format(i)}).status_code == 200
        r = post(pair_url, "/generate", {**ids, "sampling_config": greedy})
        assert r.json()["generated_text"] == text, i
