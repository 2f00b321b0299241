"""Tools in Assistants runs through the official openai SDK, in-process: function tools
(requires_action, submit_tool_outputs, polled and streamed, expiry, cancel) and file_search (an
assistant's store, a thread's store made from attachments, citations and the run
step's results), over the real routes, engine, Embedder and a real SQLite database."""

import asyncio
import json

import jsonschema
import openai
import pytest
from openai import AsyncAssistantEventHandler
from sqlalchemy import update

from deployments.api.assistants import tool_store
from deployments.config import AppConfig
from deployments.embeddings import Embedder
from deployments.state.assistants import Run
from deployments.state.base import now
from tests.local_app import MODEL, http_client, local_app, run

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks Assistants so
GREEDY = {"temperature": 0}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}}
CITY |= {"required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
CONTENT = "step_details.tool_calls[*].file_search.results[*].content"
STATIC = {"type": "static", "static": {"max_chunk_size_tokens": 100, "chunk_overlap_tokens": 20}}
BEES = (
    "Honey bees live in colonies ruled by a single queen. A forager tells her sisters "
    "where flowers are with a waggle dance whose angle points at the sun. "
) * 3
VOLCANO = (
    "Volcanoes form where magma rises through the crust. Basalt lava is runny and makes "
    "shield volcanoes such as Mauna Loa. "
) * 3


@pytest.fixture(scope="module")
def embedder():
    return Embedder(AppConfig().embeddings)


@pytest.fixture(scope="module")
def served(smollm2_engine, embedder, tmp_path_factory):
    root = tmp_path_factory.mktemp("assistant-tools")
    config = AppConfig.model_validate(
        {
            "database": {"url": f"sqlite:///{root / 'app.sqlite3'}"},
            "files": {"data_dir": str(root / "files"), "ingest_lease_s": 1.0},
            "assistants": {"run_lease_s": 3},
            "models": [{"name": MODEL}],
        }
    )
    with local_app(config, smollm2_engine, embedder) as (app, server):
        yield app, server


def scenario(served, body):  # noqa: ANN001, ANN201
    async def go():  # noqa: ANN202
        async with http_client(served[0]) as http:
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http
            )
            return await body(client)

    return run(go())


async def _weather_assistant(client, **kw):  # noqa: ANN001, ANN202
    return await client.beta.assistants.create(
        model=MODEL, instructions="Use the tools.", tools=[WEATHER], **GREEDY, **kw
    )


async def _waiting(client, a, question: str):  # noqa: ANN001, ANN202
    """A thread asking `question`, and its run, waiting for get_weather's output."""
    thread = await client.beta.threads.create(messages=[{"role": "user", "content": question}])
    return thread, await client.beta.threads.runs.create_and_poll(
        thread_id=thread.id, assistant_id=a.id, tool_choice=FORCED, max_completion_tokens=40
    )


async def refused(call) -> str:  # noqa: ANN001
    """The message of the 400 that `call` (a coroutine) must answer."""
    with pytest.raises(openai.BadRequestError) as exc:
        await call
    return exc.value.message


def outputs(calls, output: str) -> list[dict]:  # noqa: ANN001
    return [{"tool_call_id": c.id, "output": output} for c in calls]


class Recorder(AsyncAssistantEventHandler):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.created: list = []
        self.done: list = []
        self.texts: list[str] = []

    async def on_event(self, event) -> None:  # noqa: ANN001
        self.names.append(event.event)

    async def on_tool_call_created(self, tool_call) -> None:  # noqa: ANN001
        self.created.append(tool_call)

    async def on_tool_call_done(self, tool_call) -> None:  # noqa: ANN001
        self.done.append(tool_call)

    async def on_text_delta(self, delta, snapshot) -> None:  # noqa: ANN001
        self.texts.append(delta.value)


def test_function_call_waits_for_its_output_then_answers(served):
    server = served[1]

    async def body(client):  # noqa: ANN001, ANN202
        a = await _weather_assistant(client)
        thread, waiting = await _waiting(client, a, "What is the weather in Paris?")
        runs, tid = client.beta.threads.runs, thread.id
        during = await client.beta.threads.messages.list(tid)
        busy = await refused(client.beta.threads.messages.create(tid, role="user", content="Hi"))
        calls = waiting.required_action.submit_tool_outputs.tool_calls
        wrong = await refused(
            runs.submit_tool_outputs(
                waiting.id, thread_id=tid, tool_outputs=[{"tool_call_id": "call_nope"}]
            )
        )
        missing = await refused(
            runs.submit_tool_outputs(waiting.id, thread_id=tid, tool_outputs=[])
        )
        before = await server.stats()
        done = await runs.submit_tool_outputs_and_poll(
            run_id=waiting.id, thread_id=tid, tool_outputs=outputs(calls, "18 C and sunny")
        )
        continued = (await server.stats())["num_prompt_tokens"] - before["num_prompt_tokens"]
        again = await refused(
            runs.submit_tool_outputs(waiting.id, thread_id=tid, tool_outputs=outputs(calls, "x"))
        )
        # A later run renders the call and its output as the continuation did: the
        # thread's context is extended by the new turn alone.
        await client.beta.threads.messages.create(tid, role="user", content="Thanks!")
        before = await server.stats()
        later = await runs.create_and_poll(
            thread_id=tid, assistant_id=a.id, tool_choice="none", max_completion_tokens=8
        )
        new_tokens = (await server.stats())["num_prompt_tokens"] - before["num_prompt_tokens"]
        steps = await runs.steps.list(waiting.id, thread_id=tid, order="asc")
        messages = await client.beta.threads.messages.list(tid, order="asc")
        errors = (busy, wrong, missing, again)
        return waiting, during, errors, done, steps, messages, later, (continued, new_tokens)

    waiting, during, errors, done, steps, messages, later, computed = scenario(served, body)
    continued, new_tokens = computed
    busy, wrong, missing, again = errors
    assert waiting.status == "requires_action" and waiting.expires_at > now()
    assert waiting.tools[0].function.name == "get_weather"
    (call,) = waiting.required_action.submit_tool_outputs.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    assert [m.role for m in during.data] == ["user"]  # no reply while it waits
    assert "is active" in busy
    assert "call_nope" in wrong and call.id in missing and "do not accept tool outputs" in again
    assert done.status == "completed" and done.required_action is None
    assert done.usage.prompt_tokens > waiting.usage.prompt_tokens  # both generations counted
    assert [s.type for s in steps.data] == ["tool_calls", "message_creation"]
    answered = steps.data[0].step_details.tool_calls[0]
    assert answered.id == call.id and answered.function.output == "18 C and sunny"
    assert steps.data[0].status == "completed"
    assert [m.role for m in messages.data] == ["user", "assistant", "user", "assistant"]
    assert messages.data[1].run_id == waiting.id and messages.data[1].content[0].text.value
    assert later.status in ("completed", "incomplete")
    assert 0 < new_tokens < 20, new_tokens
    # The continuation computes its own tokens (the output, the turn's markers) and the
    # tail of the call, which the grammar spelled in other tokens than the template
    # does: not the prompt's head, which showing the functions to the forced call and
    # hiding them from the continuation changed (all ~190 tokens were computed again).
    assert 0 < continued < 64, continued


def test_streamed_calls_reach_the_sdks_handler_then_the_outputs_stream(served):
    async def body(client):  # noqa: ANN001, ANN202
        a = await _weather_assistant(client)
        thread = await client.beta.threads.create(
            messages=[{"role": "user", "content": "Weather in Rome?"}]
        )
        first, second = Recorder(), Recorder()
        async with client.beta.threads.runs.stream(
            thread_id=thread.id,
            assistant_id=a.id,
            tool_choice="required",
            parallel_tool_calls=False,  # else this small model calls until its budget ends
            max_completion_tokens=40,
            event_handler=first,
        ) as stream:
            await stream.until_done()
            waiting = await stream.get_final_run()
        async with client.beta.threads.runs.submit_tool_outputs_stream(
            run_id=waiting.id,
            thread_id=thread.id,
            tool_outputs=outputs(waiting.required_action.submit_tool_outputs.tool_calls, "25 C"),
            event_handler=second,
        ) as stream:
            await stream.until_done()
            final = await stream.get_final_run()
        messages = await client.beta.threads.messages.list(thread.id)
        return first, waiting, second, final, messages

    first, waiting, second, final, messages = scenario(served, body)
    assert waiting.status == "requires_action" and first.names[-1] == "thread.run.requires_action"
    assert waiting.tool_choice == "required" and waiting.parallel_tool_calls is False
    assert "thread.run.step.delta" in first.names and "thread.message.created" not in first.names
    called = waiting.required_action.submit_tool_outputs.tool_calls
    assert [c.id for c in first.created] == [c.id for c in called]
    assert [c.function.name for c in first.created] == ["get_weather"]
    # The SDK assembled each call from its deltas: the whole arguments at done.
    assert [c.function.arguments for c in first.done] == [c.function.arguments for c in called]
    assert second.names[0] == "thread.run.step.completed"
    assert final.status in ("completed", "incomplete")
    assert second.names[-1] == f"thread.run.{final.status}"
    assert "".join(second.texts) == messages.data[0].content[0].text.value


def test_a_waiting_run_expires_or_is_cancelled_and_refused_tools(served, monkeypatch):
    db = served[0].state.assistants.store.db

    async def body(client):  # noqa: ANN001, ANN202
        a = await _weather_assistant(client)
        thread, waiting = await _waiting(client, a, "Weather in Oslo?")
        runs, tid = client.beta.threads.runs, thread.id
        busy = await refused(runs.create(thread_id=tid, assistant_id=a.id))

        def lapse(s) -> None:  # noqa: ANN001
            s.execute(update(Run).where(Run.id == waiting.id).values(expires_at=now() - 1))

        await db.work(lapse)
        expired = await runs.retrieve(waiting.id, thread_id=tid)
        steps = await runs.steps.list(waiting.id, thread_id=tid)
        late = await refused(runs.submit_tool_outputs(waiting.id, thread_id=tid, tool_outputs=[]))
        # The constant decides the next wait: a run that asks now has 3 s to be answered.
        monkeypatch.setattr(tool_store, "RUN_EXPIRES_AFTER_S", 3)
        second = await runs.create_and_poll(
            thread_id=tid, assistant_id=a.id, tool_choice=FORCED, max_completion_tokens=40
        )
        asked_by = now()
        await asyncio.sleep(4.1)
        freed = await client.beta.threads.messages.create(tid, role="user", content="Hi")
        second_now = await runs.retrieve(second.id, thread_id=tid)
        monkeypatch.undo()
        _, third = await _waiting(client, a, "Weather in Lima?")
        cancelled = await runs.cancel(third.id, thread_id=third.thread_id)
        create, code = client.beta.assistants.create, [{"type": "code_interpreter"}]
        nope = {"type": "function", "function": {"name": "nope"}}
        bad = [  # each awaited in turn by `refused`
            create(model=MODEL, tools=code),
            create(model=MODEL, tool_resources={"code_interpreter": {"file_ids": ["f"]}}),
            client.beta.threads.messages.create(
                tid, role="user", content="Hi", attachments=[{"file_id": "f", "tools": code}]
            ),
            runs.create(thread_id=tid, assistant_id=a.id, tool_choice=nope),
            create(model=MODEL, tools=[WEATHER, WEATHER]),
        ]
        refusals = [await refused(call) for call in bad]
        ends = (second, asked_by, freed, second_now, cancelled)
        return busy, expired, steps, late, ends, refusals

    busy, expired, steps, late, ends, refusals = scenario(served, body)
    second, asked_by, freed, second_now, cancelled = ends
    assert "active run" in busy
    assert expired.status == "expired" and expired.required_action is None
    assert steps.data[0].status == "expired" and steps.data[0].expired_at
    assert "expired" in late
    assert second.status == "requires_action" and second.expires_at <= asked_by + 3
    assert freed.role == "user" and second_now.status == "expired"
    assert cancelled.status == "cancelled" and cancelled.cancelled_at  # no wait for a lease
    assert all("code_interpreter is not served" in r for r in refusals[:3])
    assert "nope" in refusals[3] and "unique" in refusals[4]


async def _store(client, files: dict[str, str]):  # noqa: ANN001, ANN202
    store = await client.vector_stores.create(name="notes", chunking_strategy=STATIC)
    uploads = [(name, text.encode()) for name, text in files.items()]
    batch = await client.vector_stores.file_batches.upload_and_poll(
        store.id, files=uploads, poll_interval_ms=100, chunking_strategy=STATIC
    )
    assert batch.file_counts.completed == len(files)
    return store


def test_file_search_cites_the_assistants_store(served):
    server = served[1]

    async def body(client):  # noqa: ANN001, ANN202
        store = await _store(client, {"bees.md": BEES, "volcano.txt": VOLCANO})
        a = await client.beta.assistants.create(
            model=MODEL,
            instructions="Answer from the excerpts.",
            tools=[{"type": "file_search", "file_search": {"max_num_results": 2}}],
            tool_resources={"file_search": {"vector_store_ids": [store.id]}},
            **GREEDY,
        )
        thread = await client.beta.threads.create(
            messages=[{"role": "user", "content": "How do bees tell where flowers are?"}]
        )
        runs = client.beta.threads.runs
        done = await runs.create_and_poll(
            thread_id=thread.id, assistant_id=a.id, max_completion_tokens=48
        )
        plain = await runs.steps.list(done.id, thread_id=thread.id, order="asc")
        full = await runs.steps.list(done.id, thread_id=thread.id, order="asc", include=[CONTENT])
        messages = await client.beta.threads.messages.list(thread.id, order="asc")
        files = {f.id: f.filename async for f in client.files.list()}
        # A second run renders the first message with its excerpts as the first run did:
        # the thread's context is extended, not computed again.
        await client.beta.threads.messages.create(thread.id, role="user", content="And ants?")
        before = await server.stats()
        second = await runs.create_and_poll(
            thread_id=thread.id, assistant_id=a.id, max_completion_tokens=8
        )
        after = await server.stats()
        new_tokens = after["num_prompt_tokens"] - before["num_prompt_tokens"]
        return a, done, plain, full, messages, files, (second, new_tokens)

    a, done, plain, full, messages, files, (second, new_tokens) = scenario(served, body)
    assert a.tools[0].type == "file_search" and a.tool_resources.file_search.vector_store_ids
    assert done.status in ("completed", "incomplete")
    # Two chunks (up to 100 tokens each) go before the question, which with the
    # instructions and the template takes about 40.
    assert done.usage.prompt_tokens > 120, done.usage.prompt_tokens
    assert [s.type for s in plain.data] == ["tool_calls", "message_creation"]
    (search,) = plain.data[0].step_details.tool_calls
    assert search.type == "file_search" and len(search.file_search.results) == 2
    assert files[search.file_search.results[0].file_id] == "bees.md"
    assert search.file_search.results[0].file_name == "bees.md"
    assert search.file_search.results[0].content is None  # not asked for
    shown = full.data[0].step_details.tool_calls[0].file_search.results[0]
    assert "waggle dance" in shown.content[0].text
    reply = messages.data[1].content[0].text
    cited = {x.file_citation.file_id for x in reply.annotations}
    assert reply.annotations and cited <= set(files)
    assert all(x.type == "file_citation" for x in reply.annotations)
    assert 0 < new_tokens <= second.usage.prompt_tokens - done.usage.prompt_tokens


def test_attachments_make_the_threads_store(served):
    async def body(client):  # noqa: ANN001, ANN202
        upload = client.files.create
        bees = await upload(file=("bees.md", BEES.encode()), purpose="assistants")
        volcano = await upload(file=("volcano.txt", VOLCANO.encode()), purpose="assistants")
        search = [{"type": "file_search"}]
        a = await client.beta.assistants.create(model=MODEL, tools=search, **GREEDY)
        first = {"role": "user", "content": "What makes shield volcanoes?"}
        first["attachments"] = [{"file_id": volcano.id, "tools": search}]
        thread = await client.beta.threads.create(messages=[first])
        made = thread.tool_resources.file_search.vector_store_ids
        attached = [{"file_id": bees.id, "tools": search}]
        await client.beta.threads.messages.create(
            thread.id, role="user", content="Which lava is runny?", attachments=attached
        )
        later = await client.beta.threads.retrieve(thread.id)
        listed = [f.id async for f in client.vector_stores.files.list(made[0])]
        handler = Recorder()
        async with client.beta.threads.runs.stream(
            thread_id=thread.id,
            assistant_id=a.id,
            max_completion_tokens=32,
            include=[CONTENT],
            event_handler=handler,
        ) as stream:
            await stream.until_done()
            done = await stream.get_final_run()
        steps = await client.beta.threads.runs.steps.list(done.id, thread_id=thread.id)
        messages = await client.beta.threads.messages.list(thread.id, order="asc")
        return bees, volcano, made, later, listed, (done, handler), steps, messages

    bees, volcano, made, later, listed, (done, handler), steps, messages = scenario(served, body)
    assert len(made) == 1 and made[0].startswith("vs_")
    assert later.tool_resources.file_search.vector_store_ids == made  # one store, both files
    assert sorted(listed) == sorted([bees.id, volcano.id])
    assert messages.data[0].attachments[0].file_id == volcano.id
    assert done.status in ("completed", "incomplete")
    (search,) = handler.created  # streamed with its results' text, as `include` asked
    assert search.type == "file_search" and handler.done[0].id == search.id
    assert search.file_search.results[0].file_id == volcano.id
    assert "Basalt" in search.file_search.results[0].content[0].text
    stored = next(s for s in steps.data if s.type == "tool_calls").step_details.tool_calls[0]
    assert stored.id == search.id and stored.file_search.results[0].content is None
    assert messages.data[-1].role == "assistant" and messages.data[-1].content[0].text.annotations
