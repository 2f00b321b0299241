"""With several keys, each key sees only the assistants, threads (their messages, runs and
steps) and stored responses it made: another key's ids are 404s, as OpenAI answers; an
admin key sees all. And what one request may pin: OpenAI's limits on a message (256,000
characters) and a thread (100,000 messages), and a run that leaves a long thread's oldest
messages out before it renders anything."""

import openai
import pytest

import deployments.api.assistants.runs as runs_module
import deployments.api.assistants.store as assistants_store
from deployments.config import AppConfig
from deployments.state.assistants import Assistant
from tests.local_app import MODEL, http_client, local_app, run

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks Assistants so
KEYS = {"a": "sk-owner-a", "b": "sk-owner-b", "admin": "sk-owner-admin"}


@pytest.fixture(scope="module")
def served(smollm2_engine, tmp_path_factory):
    db = tmp_path_factory.mktemp("owners") / "app.sqlite3"
    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "assistants": {"database_path": str(db)},
            "models": [{"name": MODEL}],
            "api_keys": [KEYS["a"], KEYS["b"]],
            "admin_api_keys": [KEYS["admin"]],
        }
    )
    with local_app(config, smollm2_engine) as (app, _):
        yield app


def as_keys(app, body):  # noqa: ANN001, ANN201
    """`body(clients)`: an SDK client for each key, over the one app."""

    async def go():  # noqa: ANN202
        async with http_client(app) as http:
            clients = {
                who: openai.AsyncOpenAI(
                    base_url="http://localhost/v1", api_key=key, http_client=http
                )
                for who, key in KEYS.items()
            }
            return await body(clients)

    return run(go())


async def _404s(*calls) -> list[int]:  # noqa: ANN002
    codes = []
    for call in calls:
        try:
            await call
            codes.append(200)
        except openai.APIStatusError as exc:
            codes.append(exc.status_code)
    return codes


def test_a_key_sees_only_what_it_made_and_an_admin_all(served):
    legacy = run(served.state.assistants.store.create_assistant({"model": MODEL}))  # no owner

    async def body(c):  # noqa: ANN001, ANN202
        a, b = c["a"].beta, c["b"].beta
        mine = await a.assistants.create(model=MODEL, name="a's")
        thread = await a.threads.create(messages=[{"role": "user", "content": "hi"}])
        theirs = await b.assistants.create(model=MODEL, name="b's")
        b_thread = await b.threads.create()
        tid, mid = thread.id, (await a.threads.messages.list(thread.id)).data[0].id
        refused = await _404s(
            b.assistants.retrieve(mine.id),
            b.assistants.update(mine.id, name="taken"),
            b.assistants.delete(mine.id),
            b.threads.retrieve(tid),
            b.threads.update(tid, metadata={"k": "v"}),
            b.threads.messages.list(tid),
            b.threads.messages.create(tid, role="user", content="me too"),
            b.threads.messages.retrieve(mid, thread_id=tid),
            b.threads.messages.delete(mid, thread_id=tid),
            b.threads.runs.list(tid),
            b.threads.runs.create(tid, assistant_id=theirs.id),
            b.threads.runs.create(b_thread.id, assistant_id=mine.id),  # a's assistant
            b.threads.delete(tid),
        )
        listed = {w: [x.id for x in (await c[w].beta.assistants.list(limit=100)).data] for w in c}
        admin_sees = await _404s(c["admin"].beta.assistants.retrieve(mine.id))
        still = await a.threads.messages.list(tid)
        return mine, theirs, refused, listed, admin_sees, still

    mine, theirs, refused, listed, admin_sees, still = as_keys(served, body)
    assert refused == [404] * len(refused)
    assert listed["a"] == [mine.id] and listed["b"] == [theirs.id]
    assert {mine.id, theirs.id, legacy["id"]} <= set(listed["admin"])  # also the ownerless
    assert admin_sees == [200] and [m.role for m in still.data] == ["user"]
    with served.state.assistants.store.db.engine.connect() as conn:  # ids, never keys
        owners = {r.owner for r in conn.execute(Assistant.__table__.select())}
    assert None in owners and not owners & set(KEYS.values()) and len(owners) == 3


def test_stored_responses_are_their_keys(served):
    async def body(c):  # noqa: ANN001, ANN202
        made = await c["a"].responses.create(model=MODEL, input="Hi", max_output_tokens=1)
        refused = await _404s(
            c["b"].responses.retrieve(made.id),
            c["b"].responses.input_items.list(made.id),
            c["b"].responses.create(
                model=MODEL, input="And?", previous_response_id=made.id, max_output_tokens=1
            ),
            c["b"].responses.delete(made.id),
        )
        seen = await _404s(
            c["admin"].responses.retrieve(made.id), c["a"].responses.retrieve(made.id)
        )
        return refused, seen

    refused, seen = as_keys(served, body)
    assert refused == [404, 404, 404, 404] and seen == [200, 200]


def test_message_and_thread_limits(served, monkeypatch):
    monkeypatch.setattr(assistants_store, "MAX_THREAD_MESSAGES", 3)

    async def body(c):  # noqa: ANN001, ANN202
        a = c["a"].beta
        thread = await a.threads.create(messages=[{"role": "user", "content": "one"}] * 2)
        codes = await _404s(
            a.threads.messages.create(thread.id, role="user", content="x" * 256_001),
            a.threads.messages.create(
                thread.id, role="user", content=[{"type": "text", "text": "x" * 128_001}] * 2
            ),
            a.threads.messages.create(thread.id, role="user", content="x" * 256_000),
            a.threads.messages.create(thread.id, role="user", content="one too many"),
        )
        return codes

    assert as_keys(served, body) == [400, 400, 200, 400]


def test_a_run_reads_no_more_of_a_long_thread_than_can_fit(served, monkeypatch):
    rendered: list[int] = []
    real = runs_module.prepare

    async def prepare(ingress, turn):  # noqa: ANN001, ANN202  (the real one, measured)
        rendered.append(sum(len(m["content"]) for m in turn.messages))
        return await real(ingress, turn)

    monkeypatch.setattr(runs_module, "prepare", prepare)
    long = [{"role": "user", "content": f"{i} " + "words " * 120} for i in range(40)]

    async def body(c):  # noqa: ANN001, ANN202
        a = c["a"].beta
        assistant = await a.assistants.create(model=MODEL, temperature=0)
        thread = await a.threads.create(messages=long[:32])
        for m in long[32:]:
            await a.threads.messages.create(thread.id, **m)
        return await a.threads.runs.create_and_poll(
            thread_id=thread.id,
            assistant_id=assistant.id,
            max_prompt_tokens=256,
            max_completion_tokens=2,
        )

    done = as_keys(served, body)
    assert done.status in ("completed", "incomplete") and done.usage.prompt_tokens <= 256
    whole = sum(len(m["content"]) for m in long)  # 29,000 characters
    assert rendered and max(rendered) <= 256 * runs_module.MAX_CHARS_PER_TOKEN < whole / 3
