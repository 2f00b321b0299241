"""The Responses API's file_search tool through the official openai SDK, in-process over
the real routes, Embedder and SQLite database: the turn searches the stores, its output
starts with a file_search_call item (results when included), its text carries
file_citation annotations, a streamed turn sends the search's events, and a follow-up
turn reuses the chain's context, excerpts included."""

import openai
import pytest

from deployments.config import AppConfig
from deployments.embeddings import Embedder
from tests.deployments.test_vector_stores import DOCS, STATIC
from tests.local_app import MODEL, http_client, local_app, run

QUESTION = "How do bees tell each other where the flowers are?"


@pytest.fixture(scope="module")
def served(smollm2_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("fs")
    config = AppConfig.model_validate(
        {
            "database": {"url": f"sqlite:///{root / 'app.sqlite3'}"},
            "files": {"data_dir": str(root / "files")},
            "models": [{"name": MODEL}],
        }
    )
    with local_app(config, smollm2_engine, Embedder(config.embeddings)) as (app, _):
        yield app


def scenario(app, body):  # noqa: ANN001, ANN201
    async def go():  # noqa: ANN202
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http, max_retries=0
            )
            store = await client.vector_stores.create(name="notes")
            files = [(name, text.encode()) for name, text in DOCS.items()]
            await client.vector_stores.file_batches.upload_and_poll(
                store.id, files=files, poll_interval_ms=100, chunking_strategy=STATIC
            )
            return await body(client, store.id)

    return run(go())


def _tool(store_id: str, **kw) -> dict:  # noqa: ANN003
    return {"type": "file_search", "vector_store_ids": [store_id], "max_num_results": 2, **kw}


def test_a_turn_searches_cites_and_its_follow_up_reuses_the_context(served):
    async def body(client, store_id):  # noqa: ANN001, ANN202
        first = await client.responses.create(
            model=MODEL,
            input=QUESTION,
            tools=[_tool(store_id)],
            include=["file_search_call.results"],
            temperature=0,
            max_output_tokens=24,
        )
        plain = await client.responses.create(
            model=MODEL, input=QUESTION, tools=[_tool(store_id)], temperature=0, max_output_tokens=4
        )
        second = await client.responses.create(
            model=MODEL,
            input="And what do worker bees make?",
            previous_response_id=first.id,
            tools=[_tool(store_id)],
            temperature=0,
            max_output_tokens=8,
        )
        return first, plain, second

    first, plain, second = scenario(served, body)
    search, message = first.output[0], first.output[1]
    assert search.type == "file_search_call" and search.status == "completed"
    assert search.queries == [QUESTION]
    assert search.results[0].filename == "bees.md" and "waggle" in search.results[0].text
    assert len(search.results) == 2 and search.results[0].score > 0
    assert message.type == "message" and message.content[0].text
    cited = {a.file_id for a in message.content[0].annotations}
    assert cited and cited <= {r.file_id for r in search.results}
    assert all(a.type == "file_citation" and a.filename for a in message.content[0].annotations)
    assert plain.output[0].results is None  # results only when included
    # The chain's context held the first turn whole, excerpts and reply included.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_a_streamed_turn_sends_the_search_first(served):
    async def body(client, store_id):  # noqa: ANN001, ANN202
        events = []
        stream = await client.responses.create(
            model=MODEL,
            input=QUESTION,
            tools=[_tool(store_id)],
            stream=True,
            temperature=0,
            max_output_tokens=8,
        )
        async for event in stream:
            events.append(event)
        return events

    events = scenario(served, body)
    kinds = [e.type for e in events]
    assert kinds.index("response.file_search_call.completed") < kinds.index(
        "response.output_text.delta"
    )
    done = events[-1].response
    assert done.output[0].type == "file_search_call" and done.output[1].type == "message"
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.output_index for e in added] == [0, 1]


def test_unknown_stores_and_bad_tools_are_refused(served):
    async def body(client, store_id):  # noqa: ANN001, ANN202
        errors = []
        for tools in (
            [_tool("vs_nope")],
            [_tool(store_id), _tool(store_id)],
            [{"type": "file_search", "vector_store_ids": []}],
            [_tool(store_id, max_num_results=51)],
            [_tool(store_id, ranking_options={"score_threshold": "abc"})],
            [_tool(store_id, ranking_options={"score_threshold": 5})],
            [_tool(store_id, filters={"type": ["eq"], "key": "a", "value": 1})],
        ):
            with pytest.raises(openai.APIStatusError) as exc:
                await client.responses.create(model=MODEL, input="hi", tools=tools)
            errors.append(exc.value.status_code)
        with pytest.raises(openai.BadRequestError):
            await client.responses.create(
                model=MODEL, input="hi", include=["reasoning.encrypted_content"]
            )
        return errors

    assert scenario(served, body) == [404, 400, 400, 400, 400, 400, 400]


def test_an_expired_store_is_refused_by_every_search(served):
    # The store's own search route checked its expiry; Responses' file_search did not,
    # and searched a store its owner had let lapse.
    from sqlalchemy import update

    from deployments.state.files import VectorStore

    db = served.state.retrieval.db

    async def body(client, store_id):  # noqa: ANN001, ANN202
        def lapse(s) -> None:  # noqa: ANN001
            s.execute(update(VectorStore).where(VectorStore.id == store_id).values(expires_at=1))

        await db.work(lapse)
        errors = []
        for call in (
            client.responses.create(model=MODEL, input=QUESTION, tools=[_tool(store_id)]),
            client.vector_stores.search(store_id, query=QUESTION),
        ):
            with pytest.raises(openai.BadRequestError) as exc:
                await call
            errors.append(exc.value.message)
        return errors

    assert all("has expired" in m for m in scenario(served, body))


def test_a_conversation_keeps_what_its_search_showed_the_model(served):
    # The conversation stored the turn's message as the user wrote it, without the
    # excerpts the model was shown: every later turn rendered a different history, and
    # its context was computed again from the first search on.
    async def body(client, store_id):  # noqa: ANN001, ANN202
        conv = await client.conversations.create()
        turns = []
        for text in (QUESTION, "And what do worker bees make?"):
            turns.append(
                await client.responses.create(
                    model=MODEL,
                    input=text,
                    conversation=conv.id,
                    tools=[_tool(store_id)],
                    temperature=0,
                    max_output_tokens=8,
                )
            )
        items = await client.conversations.items.list(conv.id, order="asc")
        return turns, items.data

    (first, second), items = scenario(served, body)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    users = [i for i in items if i.type == "message" and i.role == "user"]
    assert [u.content[0].text for u in users] == [QUESTION, "And what do worker bees make?"]
    assert [i.type for i in items].count("file_search_call") == 0  # as before: not an item


def test_a_turn_of_function_outputs_searches_nothing(served):
    # A turn that brings only a function's output has no user message of its own: it
    # was refused (400), though the earlier turn's excerpts are in its context still.
    weather = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}

    async def body(client, store_id):  # noqa: ANN001, ANN202
        tools = [_tool(store_id), weather]
        first = await client.responses.create(
            model=MODEL,
            input=QUESTION,
            tools=tools,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=24,
        )
        call = next(i for i in first.output if i.type == "function_call")
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
        conv = await client.conversations.create(items=[{"role": "user", "content": QUESTION}])
        return [
            await client.responses.create(
                model=MODEL, input=[output], tools=tools, max_output_tokens=4, **where
            )
            for where in ({"previous_response_id": first.id}, {"conversation": conv.id})
        ]

    for later in scenario(served, body):
        assert later.status in ("completed", "incomplete")
        assert [i.type for i in later.output][:1] != ["file_search_call"]
