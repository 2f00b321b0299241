"""OpenAI's Conversations API in-process, with the official openai SDK: conversations and
their items (create, read, update, delete, pages), each key's own, and Responses that
continue a conversation in its warm context and add their turns to it; raw bodies are
validated against the SDK's own models."""

import json

import openai
import pytest
from openai.types.conversations import Conversation, ConversationItem, ConversationItemList
from openai.types.responses import Response
from pydantic import TypeAdapter

from deployments.api.responses.conversation_store import context_id
from deployments.api.responses.item_messages import assistant_message, fold, output_new_items
from deployments.api.responses.turn import call_item, message_item, reasoning_item
from deployments.api.warm_context import held_tokens
from deployments.config import AppConfig
from tests.local_app import MODEL, http_client, local_app, run

KEYS = {"a": "sk-conv-a", "b": "sk-conv-b", "admin": "sk-conv-admin"}
A = {"Authorization": f"Bearer {KEYS['a']}"}


@pytest.fixture(scope="module")
def served(smollm2_engine, tmp_path_factory):
    # One app for the module (it steps the engine while it lives), with keys: owners.
    db = tmp_path_factory.mktemp("conversations") / "app.sqlite3"
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
    """`body(clients, http)`: an SDK client for each key, over the one app."""

    async def go():  # noqa: ANN202
        async with http_client(app) as http:
            clients = {
                who: openai.AsyncOpenAI(
                    base_url="http://localhost/v1", api_key=key, http_client=http
                )
                for who, key in KEYS.items()
            }
            return await body(clients, http)

    return run(go())


async def _codes(*calls) -> list[int]:  # noqa: ANN002
    codes = []
    for call in calls:
        try:
            await call
            codes.append(200)
        except openai.APIStatusError as exc:
            codes.append(exc.status_code)
    return codes


def test_conversations_and_their_items(served):
    async def body(c, http):  # noqa: ANN001, ANN202
        a = c["a"]
        first = [
            {"type": "message", "role": "user", "content": "Hello!"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hi there."}]},
        ]
        conv = await a.conversations.create(metadata={"topic": "tea"}, items=first)
        raw = (await http.get(f"/v1/conversations/{conv.id}", headers=A)).json()
        updated = await a.conversations.update(conv.id, metadata={"topic": "coffee"})
        got = await a.conversations.retrieve(conv.id)
        call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
        added = await a.conversations.items.create(
            conv.id,
            items=[
                {"role": "user", "content": "More?"},
                call,
                {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
            ],
        )
        newest_first = await a.conversations.items.list(conv.id)
        listed = (await http.get(f"/v1/conversations/{conv.id}/items?order=asc", headers=A)).json()
        page = await a.conversations.items.list(conv.id, order="asc", limit=2)
        paged = [i.id async for i in a.conversations.items.list(conv.id, order="asc", limit=2)]
        one = await a.conversations.items.retrieve(added.data[1].id, conversation_id=conv.id)
        raw_one = await http.get(f"/v1/conversations/{conv.id}/items/{one.id}", headers=A)
        after = await a.conversations.items.delete(one.id, conversation_id=conv.id)
        left = [i.id async for i in a.conversations.items.list(conv.id, order="asc")]
        item_gone = await _codes(a.conversations.items.retrieve(one.id, conversation_id=conv.id))
        deleted = await a.conversations.delete(conv.id)
        gone = await _codes(a.conversations.retrieve(conv.id), a.conversations.items.list(conv.id))
        return (
            conv, raw, updated, got, added, newest_first, listed, page, paged, one,
            raw_one.json(), after, left, item_gone, deleted, gone,
        )  # fmt: skip

    (conv, raw, updated, got, added, newest_first, listed, page, paged, one, raw_one, after,
     left, item_gone, deleted, gone) = as_keys(served, body)  # fmt: skip
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "tea"}
    Conversation.model_validate(raw)
    assert updated.metadata == got.metadata == {"topic": "coffee"}
    assert got.created_at == conv.created_at
    assert [i.type for i in added.data] == ["message", "function_call", "function_call_output"]
    assert added.first_id == added.data[0].id and added.last_id == added.data[-1].id
    asc = [i["id"] for i in listed["data"]]
    ConversationItemList.model_validate(listed)
    assert len(set(asc)) == 5 and [i.id for i in newest_first.data] == asc[::-1]
    assert listed["data"][0]["content"] == [{"type": "input_text", "text": "Hello!"}]
    assert listed["data"][1]["content"][0]["type"] == "output_text"
    assert page.has_more and [i.id for i in page.data] == asc[:2]
    assert paged == asc  # three pages of two, followed by the SDK through `after`
    assert one.type == "function_call" and one.call_id == "call_1"
    TypeAdapter(ConversationItem).validate_python(raw_one)
    assert after.id == conv.id and after.object == "conversation"
    assert left == [i for i in asc if i != one.id] and item_gone == [404]
    assert deleted.deleted and deleted.object == "conversation.deleted" and gone == [404, 404]


def test_bad_requests(served):
    async def body(c, http):  # noqa: ANN001, ANN202
        a = c["a"]
        conv = await a.conversations.create()
        many = [{"role": "user", "content": f"{i}"} for i in range(21)]
        bad = {"type": "web_search_call", "id": "ws_1"}
        answers = [
            await http.post(f"/v1/conversations/{conv.id}/items", json={"items": many}, headers=A),
            await http.post("/v1/conversations", json={"items": [bad]}, headers=A),
            await http.post(
                "/v1/responses",
                json={"input": "Hi", "conversation": conv.id, "previous_response_id": "resp_1"},
                headers=A,
            ),
            await http.post(
                "/v1/responses", json={"input": "Hi", "conversation": "conv_nope"}, headers=A
            ),
            await http.post(
                "/v1/conversations", json={"metadata": {f"k{i}": "v" for i in range(17)}}, headers=A
            ),
        ]
        unknown = await _codes(
            a.conversations.retrieve("conv_nope"),
            a.conversations.items.retrieve("msg_nope", conversation_id=conv.id),
            a.conversations.items.delete("msg_nope", conversation_id=conv.id),
        )
        kept = await a.conversations.items.list(conv.id)
        return [(r.status_code, r.json()["error"].get("param")) for r in answers], unknown, kept

    answers, unknown, kept = as_keys(served, body)
    assert answers[:4] == [
        (400, "items"),
        (400, "items"),
        (400, "conversation"),
        (404, "conversation"),
    ]
    assert answers[4][0] == 400
    assert unknown == [404, 404, 404] and kept.data == []  # the refused items were not added


def test_a_conversation_is_its_keys(served):
    async def body(c, http):  # noqa: ANN001, ANN202
        a, b = c["a"], c["b"]
        conv = await a.conversations.create(items=[{"role": "user", "content": "Secret."}])
        item = (await a.conversations.items.list(conv.id)).data[0].id
        refused = await _codes(
            b.conversations.retrieve(conv.id),
            b.conversations.update(conv.id, metadata={"k": "v"}),
            b.conversations.items.list(conv.id),
            b.conversations.items.create(conv.id, items=[{"role": "user", "content": "Me."}]),
            b.conversations.items.retrieve(item, conversation_id=conv.id),
            b.conversations.items.delete(item, conversation_id=conv.id),
            b.responses.create(
                model=MODEL, input="And?", conversation=conv.id, max_output_tokens=1
            ),
            b.conversations.delete(conv.id),
        )
        seen = await _codes(
            c["admin"].conversations.retrieve(conv.id), a.conversations.retrieve(conv.id)
        )
        still = await a.conversations.items.list(conv.id)
        return refused, seen, still

    refused, seen, still = as_keys(served, body)
    assert refused == [404] * 8 and seen == [200, 200]
    assert [i.content[0].text for i in still.data] == ["Secret."]


def test_an_output_folds_into_the_message_a_chain_keeps():
    output = [reasoning_item("Hm."), message_item("Let me look."), call_item("call_1", "f", "{")]
    output.append(call_item("call_2", "g", '{"a": 1}'))
    user = {"role": "user", "content": "Go."}
    folded = fold([user, *(new.message for new in output_new_items(output)), user])
    assert folded == [user, assistant_message(output), user]
    assert [len(m.get("tool_calls", [])) for m in folded] == [0, 2, 0]


def _whole_chat(asks: list[str], replies: list[str]) -> list[dict]:
    messages = []
    for ask, reply in zip(asks, [*replies, None], strict=True):
        messages.append({"role": "user", "content": ask})
        if reply is not None:
            messages.append({"role": "assistant", "content": reply})
    return messages


def test_three_turns_share_one_warm_context(served):
    asks = ["My name is Ada and I like tea.", "What is my name?", "And what do I like?"]
    ingress = served.state.ingress

    async def body(c, http):  # noqa: ANN001, ANN202
        a = c["a"]
        conv = await a.conversations.create()
        turns, held = [], []
        for i, ask in enumerate(asks):
            ref = conv.id if i % 2 else {"id": conv.id}  # both of OpenAI's forms
            turns.append(
                await a.responses.create(
                    model=MODEL, input=ask, conversation=ref, max_output_tokens=12, temperature=0
                )
            )
            held.append(await held_tokens(ingress, MODEL, context_id(conv.id)))
        chat = await a.chat.completions.create(
            model=MODEL,
            messages=_whole_chat(asks, [t.output_text for t in turns[:2]]),
            max_tokens=12,
            temperature=0,
        )
        items = [i async for i in a.conversations.items.list(conv.id, order="asc")]
        later = await a.responses.create(
            model=MODEL, input="Thanks.", previous_response_id=turns[2].id, max_output_tokens=2
        )
        own = await ingress.encode(MODEL, asks[2], add_special_tokens=False)
        return conv, turns, held, chat, items, later, len(own)

    conv, turns, held, chat, items, later, own = as_keys(served, body)
    third = turns[2].usage
    # The same three turns sent whole: the same prompt, the same greedy reply.
    assert third.input_tokens == chat.usage.prompt_tokens
    assert turns[2].output_text == chat.choices[0].message.content
    # Turn 3 computed only its own tokens: the context held the whole conversation
    # before it (turn 2's prompt and reply), and the rest is the new ask and its markers.
    assert len(held[1]) >= turns[1].usage.input_tokens + turns[1].usage.output_tokens - 1
    assert third.input_tokens_details.cached_tokens == len(held[1])
    assert own <= third.input_tokens - len(held[1]) <= own + 10
    assert turns[1].usage.input_tokens_details.cached_tokens == len(held[0])
    assert held[2][: len(held[1])] == held[1]
    assert [t.conversation.id for t in turns] == [conv.id] * 3
    assert [(i.role, i.content[0].text) for i in items] == [
        (role, text)
        for ask, turn in zip(asks, turns, strict=True)
        for role, text in (("user", ask), ("assistant", turn.output_text))
    ]
    assert [i.id for i in items[1::2]] == [t.output[0].id for t in turns]  # the outputs' own
    # Continued by previous_response_id, a conversation's response goes on from all of it.
    assert later.usage.input_tokens > third.input_tokens + third.output_tokens


def test_items_added_between_turns_streams_and_failures(served):
    ingress = served.state.ingress
    told = [
        {"role": "user", "content": "I live in Paris."},
        {"role": "assistant", "content": "Noted."},
    ]
    more = [{"role": "user", "content": "I like cats."}, {"role": "assistant", "content": "Cats!"}]

    async def body(c, http):  # noqa: ANN001, ANN202
        a = c["a"]
        conv = await a.conversations.create(items=told)
        cid = context_id(conv.id)
        first = await a.responses.create(
            model=MODEL,
            input="Where do I live?",
            conversation=conv.id,
            max_output_tokens=8,
            temperature=0,
        )
        held = await held_tokens(ingress, MODEL, cid)
        await a.conversations.items.create(conv.id, items=more)
        second = await a.responses.create(
            model=MODEL,
            input="What do I like?",
            conversation=conv.id,
            max_output_tokens=8,
            temperature=0,
        )
        messages = [*told, {"role": "user", "content": "Where do I live?"}]
        messages += [{"role": "assistant", "content": first.output_text}, *more]
        chat = await a.chat.completions.create(
            model=MODEL,
            messages=[*messages, {"role": "user", "content": "What do I like?"}],
            max_tokens=8,
            temperature=0,
        )
        events = []
        request = {"input": "Bye.", "conversation": conv.id, "max_output_tokens": 3, "stream": True}
        async with http.stream("POST", "/v1/responses", json=request, headers=A) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: ")))
        count = len([i async for i in a.conversations.items.list(conv.id)])
        failed = await http.post(
            "/v1/responses",
            json={"input": "Again.", "conversation": conv.id, "max_output_tokens": 10**7},
            headers=A,
        )
        after_failure = len([i async for i in a.conversations.items.list(conv.id)])
        before_delete = await held_tokens(ingress, MODEL, cid)
        await a.conversations.delete(conv.id)
        after_delete = await held_tokens(ingress, MODEL, cid)
        return (
            first,
            held,
            second,
            chat,
            events,
            count,
            failed,
            after_failure,
            before_delete,
            after_delete,
        )

    first, held, second, chat, events, count, failed, after_failure, before, after = as_keys(
        served, body
    )
    # The items added between the turns made the second prompt longer; the context still
    # held everything up to the first reply, and the reply is the whole chat's.
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens == len(held)
    assert second.output_text == chat.choices[0].message.content
    # A streamed turn adds its two items when it ends; a failed one adds nothing.
    final = events[-1]["response"]
    Response.model_validate(final)
    assert final["conversation"] == {"id": first.conversation.id}
    assert count == 2 + 2 + 2 + 2 + 2 and failed.status_code == 400 and after_failure == count
    # Deleting the conversation freed its context.
    assert before is not None and after is None
