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


# PostgreSQL's binaries are there wherever .ci/run ran (it installs them where missing).
NO_POSTGRES = unavailable()
POSTGRES = pytest.param(  # starts a PostgreSQL server: live
    "postgresql",
    marks=[pytest.mark.skipif(NO_POSTGRES is not None, reason=str(NO_POSTGRES)), pytest.mark.live],
)


@pytest.fixture(scope="module", params=["sqlite", POSTGRES])
def database_url(request, tmp_path_factory):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db') / 'assistants.sqlite3'}"
        return
    with postgres_server() as url:
        yield url


async def lifespan_ends(app) -> None:  # noqa: ANN001
    """The ASGI lifespan as Serve drives it when a replica stops: startup, then shutdown."""
    import asyncio

    events: asyncio.Queue = asyncio.Queue()
    for kind in ("startup", "shutdown"):
        events.put_nowait({"type": f"lifespan.{kind}"})
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, events.get, send)
    assert sent[-1]["type"] == "lifespan.shutdown.complete", sent


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
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http
            )
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
        orphan, _ = run(store.runs.create_run(thread.id, fields, None))
        run(store.runs.begin_run(orphan["id"]))
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


def test_one_active_run_per_thread_and_transitions_that_never_overwrite(database_url):
    """Racing requests never make two active runs on one thread (the database's own
    partial unique index decides); an ended run takes no cancel, and ends once."""
    import asyncio

    from app.protocol.errors import InvalidRequestError
    from deployments.api.assistants.store import AssistantsStore

    store = AssistantsStore(database_url, lease_s=30)
    runs = store.runs

    async def scenario():  # noqa: ANN202
        thread = await store.create_thread({}, [{"role": "user", "text": "hi", "meta": {}}])
        fields = {"assistant_id": "asst_x", "model": MODEL, "instructions": None}
        tries = await asyncio.gather(
            *(runs.create_run(thread["id"], fields, None) for _ in range(8)),
            return_exceptions=True,
        )
        made = [t[0] for t in tries if isinstance(t, tuple)]
        refused = [t for t in tries if isinstance(t, InvalidRequestError)]
        run_id = made[0]["id"]
        begun = await runs.begin_run(run_id)
        ended = await runs.end_run(run_id, {"status": "completed", "completed_at": 1}, {}, {})
        again = await runs.end_run(run_id, {"status": "failed"}, {}, {})
        try:
            await runs.request_cancel(thread["id"], run_id)
            late_cancel = None
        except InvalidRequestError as exc:
            late_cancel = exc
        final = await runs.get_run(thread["id"], run_id)
        return made, refused, begun, ended, again, late_cancel, final

    try:
        made, refused, begun, ended, again, late_cancel, final = asyncio.run(scenario())
    finally:
        store.close()
    assert len(made) == 1 and len(refused) == 7, (made, refused)
    assert "already has an active run" in refused[0].message
    assert begun["status"] == "in_progress" and begun["started_at"]
    assert ended[0]["status"] == "completed" and again is None
    assert late_cancel is not None and "completed" in late_cancel.message
    assert final["status"] == "completed"


def test_an_ingress_that_stops_ends_its_runs(smollm2_engine, database_url):
    """Serve runs the app's shutdown when an ingress replica stops: its runs end as failed
    at once (not after their lease), and the thread takes a new run."""

    async def stop_mid_run(client, app):  # noqa: ANN001, ANN202
        import asyncio

        a = await client.beta.assistants.create(model=MODEL, temperature=0)
        thread = await client.beta.threads.create(
            messages=[{"role": "user", "content": "Count to one thousand."}]
        )
        runs = client.beta.threads.runs
        r = await runs.create(thread_id=thread.id, assistant_id=a.id, max_completion_tokens=2000)
        while (await client.beta.threads.messages.list(thread.id, limit=1)).data[
            0
        ].role != "assistant":
            await asyncio.sleep(0.05)  # the reply has begun
        await lifespan_ends(app)
        return a, thread, r

    with app_on(smollm2_engine, database_url) as (app, _):
        a, thread, r = with_client(app, lambda client: stop_mid_run(client, app))

    async def after(client):  # noqa: ANN001, ANN202
        ended = await client.beta.threads.runs.retrieve(r.id, thread_id=thread.id)
        messages = await client.beta.threads.messages.list(thread.id)
        again = await client.beta.threads.runs.create_and_poll(
            thread_id=thread.id, assistant_id=a.id, max_completion_tokens=4
        )
        return ended, messages, again

    with app_on(smollm2_engine, database_url) as (app, _):
        ended, messages, again = with_client(app, after)
    assert ended.status == "failed" and "stopped" in ended.last_error.message
    assert messages.data[0].role == "assistant" and messages.data[0].status == "incomplete"
    assert again.status in ("completed", "incomplete")
