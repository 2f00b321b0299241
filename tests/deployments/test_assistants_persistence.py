"""The Assistants API's state outlives the app: the same tests on SQLite and on a real
PostgreSQL server started here. Each test stops the app and starts a new one on the same
database (in-process; tests/serve restarts a live Serve app)."""

import time

import openai
import pytest

from deployments.config import AppConfig
from tests.local_app import MODEL, http_client, local_app, run
from tests.postgres import postgres_server, unavailable

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks Assistants so
LEASE_S = 1.0


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def database_url(request, tmp_path_factory):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db') / 'assistants.sqlite3'}"
        return
    why = unavailable()
    if why:
        pytest.skip(why)
    with postgres_server() as url:
        yield url


def app_on(engine, url: str):  # noqa: ANN001, ANN201
    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "assistants": {"database_url": url, "run_lease_s": LEASE_S},
            "models": [{"name": MODEL}],
        }
    )
    return local_app(config, engine)


def with_client(app, body):  # noqa: ANN001, ANN201
    async def go():  # noqa: ANN202
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(base_url="http://local/v1", api_key="x", http_client=http)
            return await body(client)

    return run(go())


def test_state_survives_a_restart_and_lapsed_runs_fail(smollm2_engine, database_url):
    async def first_life(client):  # noqa: ANN001, ANN202
        a = await client.beta.assistants.create(
            model=MODEL, name="keeper", instructions="Be brief.", temperature=0
        )
        thread = await client.beta.threads.create(
            messages=[{"role": "user", "content": "Hello there."}], metadata={"user": "u1"}
        )
        done = await client.beta.threads.runs.create_and_poll(
            thread_id=thread.id, assistant_id=a.id, max_completion_tokens=12
        )
        return a, thread, done

    with app_on(smollm2_engine, database_url) as (app, _):
        a, thread, done = with_client(app, first_life)
        # A run whose ingress dies in the middle: made and marked in progress, never ended.
        store = app.state.assistants.store
        fields = {"assistant_id": a.id, "model": MODEL, "instructions": None}
        orphan, _ = run(store.create_run(thread.id, fields, None))
        run(store.set_run(orphan["id"], status="in_progress"))
    time.sleep(LEASE_S * 1.5)

    async def second_life(client):  # noqa: ANN001, ANN202
        got = await client.beta.assistants.retrieve(a.id)
        t = await client.beta.threads.retrieve(thread.id)
        messages = await client.beta.threads.messages.list(thread.id, order="asc")
        lapsed = await client.beta.threads.runs.retrieve(orphan["id"], thread_id=thread.id)
        again = await client.beta.threads.runs.create_and_poll(
            thread_id=thread.id, assistant_id=a.id, max_completion_tokens=12
        )
        runs = await client.beta.threads.runs.list(thread.id, order="asc")
        return got, t, messages, lapsed, again, runs

    with app_on(smollm2_engine, database_url) as (app, _):
        got, t, messages, lapsed, again, runs = with_client(app, second_life)
    assert got.name == "keeper" and got.instructions == "Be brief." and got.temperature == 0
    assert t.metadata == {"user": "u1"}
    assert [m.role for m in messages.data] == ["user", "assistant"]
    assert messages.data[1].run_id == done.id
    assert lapsed.status == "failed" and lapsed.last_error.code == "server_error"
    assert again.status in ("completed", "incomplete") and again.usage.completion_tokens > 0
    assert [r.id for r in runs.data] == [done.id, orphan["id"], again.id]
