"""The Assistants API on the live app, with the official (sync) openai SDK: a thread is a
context on the model replica, so a follow-up prefills only its new tokens; after the
replica's engine is killed the context is rebuilt from the database and gives the same
greedy answer; after the whole app is stopped and started again on the same database
file, everything is still there and a new run works.

Its own app (float32, so that greedy output does not depend on how a prompt was split
between cache and compute), deleted at the end.
"""

import os
import signal
import time

import openai
import pytest
from ray import serve

from tests.serve.live import wait_healthy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks Assistants so
MODEL = "smollm2-135m-instruct"
APP, PREFIX = "assistants-live", "/alive"


def build(db_path: str):  # noqa: ANN201
    from deployments.builder import build_app
    from deployments.config import AppConfig

    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "assistants": {"database_path": db_path},
            "models": [
                {
                    "num_cpus": 0.5,
                    "engine": {"dtype": "float32", "num_threads": 1, "kv_cache_memory_gib": 0.25},
                }
            ],
        }
    )
    return build_app(config)


def start(url: str, db_path: str) -> None:
    serve.run(build(db_path), name=APP, route_prefix=PREFIX, blocking=False)
    wait_healthy(url)


def stats() -> dict:
    handle = serve.get_deployment_handle(f"ModelServer:{MODEL}", app_name=APP)
    return handle.stats.remote().result(timeout_s=30)


def last_text(client: openai.OpenAI, thread_id: str) -> str:
    return client.beta.threads.messages.list(thread_id, limit=1).data[0].content[0].text.value


def test_threads_live_through_turns_a_killed_replica_and_an_app_restart(base_url, tmp_path):
    url, db = f"{base_url}{PREFIX}", str(tmp_path / "assistants.sqlite3")
    start(url, db)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        runs = client.beta.threads.runs
        a = client.beta.assistants.create(
            model=MODEL, instructions="Answer briefly.", temperature=0
        )
        thread = client.beta.threads.create(
            messages=[{"role": "user", "content": "Describe a lighthouse at night. " * 8}]
        )
        first = runs.create_and_poll(
            thread_id=thread.id, assistant_id=a.id, max_completion_tokens=32
        )
        assert first.status in ("completed", "incomplete"), first.last_error

        # A follow-up on the warm thread computes only its own turn.
        before = stats()["num_prompt_tokens"]
        client.beta.threads.messages.create(thread.id, role="user", content="Why is it red?")
        warm = runs.create_and_poll(
            thread_id=thread.id, assistant_id=a.id, max_completion_tokens=16
        )
        computed = stats()["num_prompt_tokens"] - before
        assert warm.usage.prompt_tokens > 100 and 0 < computed < 25, (computed, warm.usage)
        answer = last_text(client, thread.id)

        # The engine dies: its replica is replaced, the thread's context is gone. Take the
        # reply back and ask again: rebuilt from the stored messages, the same answer.
        reply = client.beta.threads.messages.list(thread.id, limit=1).data[0]
        client.beta.threads.messages.delete(reply.id, thread_id=thread.id)
        victim = stats()["engine_pid"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.time() + 180
        while True:
            try:
                if stats()["engine_pid"] != victim:
                    break
            except Exception:  # the replica is going or starting
                pass
            assert time.time() < deadline, "the model replica did not come back"
            time.sleep(1)
        rebuilt = runs.create_and_poll(
            thread_id=thread.id, assistant_id=a.id, max_completion_tokens=16
        )
        assert rebuilt.status == warm.status and last_text(client, thread.id) == answer
        assert stats()["num_prompt_tokens"] >= rebuilt.usage.prompt_tokens - 1  # all of it

        # The whole app stops and starts again on the same database.
        serve.delete(APP)
        start(url, db)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert client.beta.assistants.retrieve(a.id).instructions == "Answer briefly."
        roles = [m.role for m in client.beta.threads.messages.list(thread.id, order="asc")]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert [r.id for r in client.beta.threads.runs.list(thread.id)][-1] == first.id
        client.beta.threads.messages.create(thread.id, role="user", content="Thanks!")
        after = runs.create_and_poll(
            thread_id=thread.id, assistant_id=a.id, max_completion_tokens=8
        )
        assert after.status in ("completed", "incomplete") and after.usage.completion_tokens > 0
    finally:
        serve.delete(APP)
