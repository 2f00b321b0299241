"""OpenAI's Assistants API in-process, with the official openai SDK: the real routes, a
real SQLite database and the real engine (tests/local_app.py)."""

import asyncio
import json

import openai
import pytest
from openai import AsyncAssistantEventHandler

from app.protocol.errors import ShoalError
from app.protocol.messages import ContextAction, ContextOp
from deployments.api.assistants.thread_context import context_id
from deployments.config import AppConfig
from tests.local_app import MODEL, http_client, local_app, run

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks Assistants so
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def served(smollm2_engine, tmp_path_factory):
    db = tmp_path_factory.mktemp("assistants") / "assistants.sqlite3"
    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "assistants": {"database_path": str(db), "run_lease_s": 3},
            "models": [{"name": MODEL}],
        }
    )
    with local_app(config, smollm2_engine) as (app, server):
        yield app, server, db


def scenario(served, body):  # noqa: ANN001, ANN201
    app = served[0]

    async def go():  # noqa: ANN202
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http
            )
            return await body(client)

    return run(go())


async def _assistant(client, **kw):  # noqa: ANN001, ANN202
    return await client.beta.assistants.create(
        model=MODEL, instructions="You are a terse assistant.", **GREEDY, **kw
    )


def test_assistants_crud_and_errors(served):
    async def body(client):  # noqa: ANN001, ANN202
        a = await _assistant(client, name="one", metadata={"team": "a"})
        got = await client.beta.assistants.retrieve(a.id)
        up = await client.beta.assistants.update(a.id, name="renamed", top_p=0.5)
        names = [x.name for x in (await client.beta.assistants.list(limit=100)).data]
        with pytest.raises(openai.NotFoundError):
            await client.beta.assistants.create(model="no-such-model")
        with pytest.raises(openai.BadRequestError) as tools:
            await client.beta.assistants.create(model=MODEL, tools=[{"type": "code_interpreter"}])
        deleted = await client.beta.assistants.delete(a.id)
        with pytest.raises(openai.NotFoundError) as gone:
            await client.beta.assistants.retrieve(a.id)
        return a, got, up, names, tools.value, deleted, gone.value

    a, got, up, names, tools, deleted, gone = scenario(served, body)
    assert got.id == a.id and got.metadata == {"team": "a"} and got.instructions
    assert up.name == "renamed" and up.top_p == 0.5 and up.instructions == got.instructions
    assert "renamed" in names
    assert "tools" in tools.message
    assert deleted.deleted and deleted.id == a.id
    assert gone.body["type"] == "not_found_error" and a.id in gone.body["message"]


def test_messages_pagination_both_ways_and_isolation(served):
    async def body(client):  # noqa: ANN001, ANN202
        thread = await client.beta.threads.create(
            messages=[{"role": "user", "content": f"m{i}"} for i in range(5)],
            metadata={"k": "v"},
        )
        msgs = client.beta.threads.messages
        first = await msgs.list(thread.id, order="asc", limit=2)
        second = await msgs.list(thread.id, order="asc", limit=2, after=first.last_id)
        back = await msgs.list(thread.id, order="asc", limit=2, before=second.first_id)
        newest = await msgs.list(thread.id, limit=2)
        every = [m async for m in msgs.list(thread.id, order="asc", limit=2)]  # SDK's pager
        other = await client.beta.threads.create()
        with pytest.raises(openai.NotFoundError):
            await msgs.retrieve(first.data[0].id, thread_id=other.id)
        one = await msgs.update(first.data[0].id, thread_id=thread.id, metadata={"seen": "1"})
        await msgs.delete(first.data[1].id, thread_id=thread.id)
        left = await msgs.list(thread.id, order="asc", limit=100)
        updated = await client.beta.threads.update(thread.id, metadata={"k": "w"})
        await client.beta.threads.delete(thread.id)
        with pytest.raises(openai.NotFoundError):
            await msgs.list(thread.id)
        return first, second, back, newest, every, one, left, updated

    first, second, back, newest, every, one, left, updated = scenario(served, body)

    def texts(page):  # noqa: ANN001, ANN202
        return [m.content[0].text.value for m in page]

    assert texts(first.data) == ["m0", "m1"] and first.has_more
    assert texts(second.data) == ["m2", "m3"] and second.has_more
    assert texts(back.data) == ["m0", "m1"] and not back.has_more
    assert texts(newest.data) == ["m4", "m3"]
    assert texts(every) == [f"m{i}" for i in range(5)]
    assert one.metadata == {"seen": "1"}
    assert texts(left.data) == ["m0", "m2", "m3", "m4"]
    assert updated.metadata == {"k": "w"}


def test_run_poll_then_follow_up_prefills_only_new_tokens(served):
    server = served[1]

    async def body(client):  # noqa: ANN001, ANN202
        a = await _assistant(client)
        thread = await client.beta.threads.create(
            messages=[{"role": "user", "content": "Tell me about the sea in two sentences."}]
        )
        runs = client.beta.threads.runs
        first = await runs.create_and_poll(
            thread_id=thread.id, assistant_id=a.id, max_completion_tokens=48
        )
        before = await server.stats()
        await client.beta.threads.messages.create(thread.id, role="user", content="And rivers?")
        second = await runs.create_and_poll(
            thread_id=thread.id, assistant_id=a.id, max_completion_tokens=48
        )
        after = await server.stats()
        messages = await client.beta.threads.messages.list(thread.id, order="asc")
        steps = await runs.steps.list(second.id, thread_id=thread.id)
        listed = await runs.list(thread.id)
        return first, second, before, after, messages, steps, listed

    first, second, before, after, messages, steps, listed = scenario(served, body)
    assert first.status in ("completed", "incomplete") and first.usage.completion_tokens > 0
    assert first.started_at and (first.completed_at or first.incomplete_details)
    assert second.status in ("completed", "incomplete")
    # The history (first prompt + reply) stays in the context: only the new turn is computed.
    new_tokens = after["num_prompt_tokens"] - before["num_prompt_tokens"]
    assert 0 < new_tokens < 30, new_tokens
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    roles = [m.role for m in messages.data]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert messages.data[1].run_id == first.id and messages.data[1].content[0].text.value
    assert steps.data[0].step_details.message_creation.message_id == messages.data[3].id
    assert [r.id for r in listed.data] == [second.id, first.id]


def test_streamed_run_with_the_sdks_event_handler(served):
    class Handler(AsyncAssistantEventHandler):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []
            self.pieces: list[str] = []
            self.snapshot = ""
            self.done: list = []
            self.texts_created = 0

        async def on_event(self, event) -> None:  # noqa: ANN001
            self.names.append(event.event)

        async def on_text_delta(self, delta, snapshot) -> None:  # noqa: ANN001
            self.pieces.append(delta.value)
            self.snapshot = snapshot.value

        async def on_message_done(self, message) -> None:  # noqa: ANN001
            self.done.append(message)

        async def on_text_created(self, text) -> None:  # noqa: ANN001
            self.texts_created += 1

    async def body(client):  # noqa: ANN001, ANN202
        a = await _assistant(client)
        thread = await client.beta.threads.create(
            messages=[{"role": "user", "content": "Say hello."}]
        )
        handler = Handler()
        async with client.beta.threads.runs.stream(
            thread_id=thread.id, assistant_id=a.id, max_completion_tokens=24, event_handler=handler
        ) as stream:
            await stream.until_done()
            final = await stream.get_final_run()
            final_messages = await stream.get_final_messages()
        messages = await client.beta.threads.messages.list(thread.id)
        return handler, final, final_messages, messages

    handler, final, final_messages, messages = scenario(served, body)
    names, stored = handler.names, messages.data[0].content[0].text.value
    assert names[0] == "thread.run.created" and names[-1] == f"thread.run.{final.status}"
    for name in ("thread.run.in_progress", "thread.message.created", "thread.message.delta"):
        assert name in names
    assert names.index("thread.message.created") < names.index("thread.message.delta")
    assert "".join(handler.pieces) == handler.snapshot == stored  # the SDK's accumulation
    assert handler.texts_created == 1
    assert [m.id for m in handler.done] == [m.id for m in final_messages] == [messages.data[0].id]
    assert final_messages[0].content[0].text.value == stored
    assert final.usage.completion_tokens > 0


def test_cancel_mid_run_and_idempotent_retries(served):
    async def body(client):  # noqa: ANN001, ANN202
        a = await _assistant(client)
        thread = await client.beta.threads.create()
        key = {"Idempotency-Key": "k-1"}
        m1 = await client.beta.threads.messages.create(
            thread.id, role="user", content="Count to one thousand.", extra_headers=key
        )
        m2 = await client.beta.threads.messages.create(
            thread.id, role="user", content="Count to one thousand.", extra_headers=key
        )
        runs = client.beta.threads.runs
        run_key = {"Idempotency-Key": "r-1"}
        r1 = await runs.create(
            thread_id=thread.id,
            assistant_id=a.id,
            max_completion_tokens=2000,
            extra_headers=run_key,
        )
        r2 = await runs.create(
            thread_id=thread.id,
            assistant_id=a.id,
            max_completion_tokens=2000,
            extra_headers=run_key,
        )
        with pytest.raises(openai.BadRequestError) as busy:
            await runs.create(thread_id=thread.id, assistant_id=a.id)
        while (await runs.retrieve(r1.id, thread_id=thread.id)).status != "in_progress":
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        cancelling = await runs.cancel(r1.id, thread_id=thread.id)
        ended = await runs.poll(r1.id, thread_id=thread.id)
        messages = await client.beta.threads.messages.list(thread.id, order="asc")
        listed = await runs.list(thread.id)
        after = await runs.create_and_poll(
            thread_id=thread.id, assistant_id=a.id, max_completion_tokens=4
        )
        return m1, m2, r1, r2, busy.value, cancelling, ended, messages, listed, after

    m1, m2, r1, r2, busy, cancelling, ended, messages, listed, after = scenario(served, body)
    assert m1.id == m2.id and r1.id == r2.id
    assert "active run" in busy.message
    assert cancelling.status in ("cancelling", "cancelled")
    assert ended.status == "cancelled" and ended.cancelled_at
    assert [m.role for m in messages.data] == ["user", "assistant"]
    assert messages.data[1].status == "incomplete"
    assert len(listed.data) == 1
    assert after.status in ("completed", "incomplete")


def test_create_and_run_and_a_lost_context_rebuilt(served):
    server = served[1]

    async def body(client):  # noqa: ANN001, ANN202
        a = await _assistant(client)
        runs = client.beta.threads.runs
        first = await client.beta.threads.create_and_run_poll(
            assistant_id=a.id,
            thread={"messages": [{"role": "user", "content": "Name three colours."}]},
            max_completion_tokens=24,
        )
        thread_id = first.thread_id
        await client.beta.threads.messages.create(thread_id, role="user", content="One more?")
        warm = await runs.create_and_poll(
            thread_id=thread_id, assistant_id=a.id, max_completion_tokens=24
        )
        warm_text = (
            (await client.beta.threads.messages.list(thread_id)).data[0].content[0].text.value
        )
        # Lose the context (as a restarted replica would), then run the same turn again.
        await client.beta.threads.messages.delete(
            (await client.beta.threads.messages.list(thread_id)).data[0].id, thread_id=thread_id
        )
        await server.free_context(ContextOp(context_id(thread_id), ContextAction.FREE))
        cold = await runs.create_and_poll(
            thread_id=thread_id, assistant_id=a.id, max_completion_tokens=24
        )
        cold_text = (
            (await client.beta.threads.messages.list(thread_id)).data[0].content[0].text.value
        )
        return first, warm, warm_text, cold, cold_text

    first, warm, warm_text, cold, cold_text = scenario(served, body)
    assert first.status in ("completed", "incomplete") and first.thread_id.startswith("thread_")
    assert warm_text and cold_text == warm_text  # greedy: the same answer, rebuilt or not
    assert cold.usage.prompt_tokens == warm.usage.prompt_tokens


def test_deleting_a_thread_mid_run_stops_its_work(served):
    server = served[1]

    async def body(client):  # noqa: ANN001, ANN202
        a = await _assistant(client)
        thread = await client.beta.threads.create(
            messages=[{"role": "user", "content": "Count to one thousand."}]
        )
        runs = client.beta.threads.runs
        r = await runs.create(thread_id=thread.id, assistant_id=a.id, max_completion_tokens=2000)
        while (await runs.retrieve(r.id, thread_id=thread.id)).status != "in_progress":
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        deleted = await client.beta.threads.delete(thread.id)
        with pytest.raises(openai.NotFoundError):
            await runs.retrieve(r.id, thread_id=thread.id)
        read = ContextOp(context_id(thread.id), ContextAction.READ)
        for _ in range(100):  # the generation is cancelled, the context freed
            stats = await server.stats()
            try:
                await server.context_tokens(read)
            except ShoalError as exc:
                if stats["num_running"] == 0 and exc.status_code == 404:
                    break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"still running or held: {stats}")
        # The same assistant carries on with other threads.
        other = await client.beta.threads.create_and_run_poll(
            assistant_id=a.id,
            thread={"messages": [{"role": "user", "content": "Hi"}]},
            max_completion_tokens=4,
        )
        return deleted, stats, other

    deleted, stats, other = scenario(served, body)
    assert deleted.deleted
    assert other.status in ("completed", "incomplete")


def test_a_retried_stream_follows_the_first_attempts_run(served):
    async def body(client):  # noqa: ANN001, ANN202
        a = await _assistant(client)
        thread = await client.beta.threads.create(
            messages=[{"role": "user", "content": "Say hello."}]
        )
        key = {"Idempotency-Key": "stream-1"}
        finals = []
        for _ in range(2):  # the second is the SDK retrying with the same key
            async with client.beta.threads.runs.stream(
                thread_id=thread.id, assistant_id=a.id, max_completion_tokens=12, extra_headers=key
            ) as stream:
                await stream.until_done()
                finals.append((await stream.get_final_run(), await stream.get_final_messages()))
        runs = await client.beta.threads.runs.list(thread.id)
        return finals, runs

    (run1, msgs1), (run2, msgs2) = scenario(served, body)[0]
    runs = scenario(served, lambda c: c.beta.threads.runs.list(run1.thread_id))
    assert run1.id == run2.id and run2.status == run1.status != "queued"
    assert [m.id for m in msgs2] == [m.id for m in msgs1]
    assert msgs2[0].content[0].text.value == msgs1[0].content[0].text.value
    assert len(runs.data) == 1


def test_a_run_under_a_json_schema_answers_in_it(served):
    schema = {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "why": {"type": "string", "maxLength": 80},
        },
        "required": ["colour", "why"],
        "additionalProperties": False,
    }

    async def body(client):  # noqa: ANN001, ANN202
        fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
        a = await _assistant(client, response_format=fmt)
        thread = await client.beta.threads.create(
            messages=[{"role": "user", "content": "Which colour is the sky?"}]
        )
        done = await client.beta.threads.runs.create_and_poll(
            thread_id=thread.id, assistant_id=a.id, max_completion_tokens=80
        )
        messages = await client.beta.threads.messages.list(thread.id, order="asc")
        with pytest.raises(openai.BadRequestError) as bad:
            await _assistant(
                client, response_format={"type": "json_schema", "json_schema": {"name": "x"}}
            )
        return done, messages, bad.value

    done, messages, bad = scenario(served, body)
    assert done.status == "completed"
    answer = messages.data[1].content[0].text.value
    assert json.loads(answer)["colour"] in ("red", "green", "blue")
    assert "schema" in bad.message
