"""OpenAI's Responses API in-process, with the official openai SDK: whole and streamed
replies, instructions, previous_response_id chains kept warm in a context (and parallel
branches from one response), stored responses and their input items, function tools and
text formats; raw bodies and events validated against the SDK's own models."""

import asyncio
import json
import typing

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter

from deployments.api.responses.routes import context_id
from deployments.api.warm_context import held_tokens
from tests.local_app import MODEL, http_client, run

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


# The SDK builds its objects without validation: the raw JSON is checked against its
# models here, each event against the model its `type` names.
EVENT_MODELS = {
    typing.get_args(m.model_fields["type"].annotation)[0]: m
    for m in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}


async def _raw_events(http, body: dict) -> list[dict]:  # noqa: ANN001
    events = []
    async with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    for event in events:
        EVENT_MODELS[event["type"]].model_validate(event)
    return events


def _client_run(app, fn):  # noqa: ANN001, ANN202
    async def scenario():
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http
            )
            return await fn(client, http)

    return run(scenario())


def test_create_stream_and_instructions(app):
    async def scenario(client, http):  # noqa: ANN001, ANN202
        ask = "Name a colour."
        whole = await client.responses.create(
            model=MODEL, input=ask, max_output_tokens=8, temperature=0
        )
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": ask}], max_tokens=8, temperature=0
        )
        led = await client.responses.create(
            model=MODEL, input=ask, instructions="Answer in French.", max_output_tokens=2
        )
        system = [{"role": "system", "content": "Answer in French."}]
        led_chat = await client.chat.completions.create(
            model=MODEL, messages=[*system, {"role": "user", "content": ask}], max_tokens=2
        )
        events = []
        async with client.responses.stream(
            model=MODEL, input=ask, max_output_tokens=8, temperature=0
        ) as stream:
            async for event in stream:
                events.append(event)
        # Cut by max_output_tokens, the stream ends in response.incomplete, as OpenAI's
        # does (the SDK's get_final_response wants response.completed).
        final = events[-1].response
        return whole, chat, led, led_chat, events, final

    whole, chat, led, led_chat, events, final = _client_run(app, scenario)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.status in ("completed", "incomplete") and whole.id.startswith("resp_")
    assert led.instructions == "Answer in French."
    assert led.usage.input_tokens == led_chat.usage.prompt_tokens != whole.usage.input_tokens
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if final.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text


def test_a_chain_of_three_reuses_its_context(app):
    async def scenario(client, http):  # noqa: ANN001, ANN202
        create = client.responses.create
        first = await create(
            model=MODEL, input="My name is Ada and I like tea.", max_output_tokens=12
        )
        cid = context_id(first.id)
        second = await create(
            model=MODEL,
            input=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "input_text", "text": "My name?"}]},
            ],
            previous_response_id=first.id,
            max_output_tokens=12,
        )
        held_after_second = await held_tokens(app.state.ingress, MODEL, cid)
        third = await create(
            model=MODEL,
            input="And what do I like?",
            previous_response_id=second.id,
            max_output_tokens=12,
        )
        held_after_third = await held_tokens(app.state.ingress, MODEL, cid)
        got = await client.responses.retrieve(second.id)
        raw = (await http.get(f"/v1/responses/{second.id}")).json()
        listed = await http.get(f"/v1/responses/{second.id}/input_items")
        paged = [
            i async for i in client.responses.input_items.list(second.id, order="asc", limit=1)
        ]
        await client.responses.delete(third.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(third.id)
        with pytest.raises(openai.NotFoundError) as unknown:
            await create(model=MODEL, input="Hi", previous_response_id="resp_nope")
        alone = await create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(alone.id)
        return (
            first, second, third, held_after_second, held_after_third, got, raw, listed, paged,
            unknown.value,
        )  # fmt: skip

    first, second, third, held2, held3, got, raw, listed, paged, unknown = _client_run(
        app, scenario
    )
    # Each turn's prompt holds the whole conversation so far...
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    # ...and the chain's one context held all of it but the new turn: the third turn's
    # cached tokens are exactly what the context held after the second (the prefix cache
    # alone would give a whole number of blocks), and it now holds the third's prompt.
    assert len(held2) >= second.usage.input_tokens + second.usage.output_tokens - 1
    assert third.usage.input_tokens_details.cached_tokens == len(held2)
    assert len(held3) >= third.usage.input_tokens and held3[: len(held2)] == held2
    assert third.previous_response_id == second.id
    assert got.id == second.id and got.output_text == second.output_text
    Response.model_validate(raw)
    assert listed.json()["data"][0]["content"][0]["text"] == "My name?"  # newest first
    TypeAdapter(list[ResponseItem]).validate_python(listed.json()["data"])
    assert [i.role for i in paged] == ["developer", "user"]  # two pages of one
    assert unknown.body["param"] == "previous_response_id"


def test_parallel_branches_from_one_response(app):
    """While one branch generates in the chain's context, another branch from the same
    response runs beside it (without the context) instead of waiting for it to end."""

    async def scenario(client, http):  # noqa: ANN001, ANN202
        create = client.responses.create
        first = await create(model=MODEL, input="Hi, I am Ada.", max_output_tokens=4)
        done: list[str] = []

        async def generating() -> None:  # the long branch holds the context from here
            while not any(s["is_processing"] for s in (await http.get("/slots")).json()):
                await asyncio.sleep(0.01)

        async def branch(name: str, text: str, tokens: int, wait: bool) -> Response:
            if wait:
                await asyncio.wait_for(generating(), 60)
            reply = await create(
                model=MODEL, input=text, previous_response_id=first.id, max_output_tokens=tokens
            )
            done.append(name)
            return reply

        # (The in-process transport delivers a stream whole: two plain calls, the short
        # one started once the long one generates, however loaded the machine. The long
        # one is long enough to outlast the short one's wait for the busy context on a
        # fast machine: 24 tokens did not.)
        long, short = await asyncio.gather(
            branch("long", "Tell a story.", 96, False), branch("short", "My name?", 2, True)
        )
        return long, short, done

    long, short, done = _client_run(app, scenario)
    assert long.usage.input_tokens_details.cached_tokens > 0  # the long one had the context
    assert long.status == "incomplete"  # it ran to its limit
    assert short.status == "incomplete" and short.output_text
    assert done == ["short", "long"]


def test_function_tool_and_its_output(app):
    async def scenario(client, http):  # noqa: ANN001, ANN202
        called = await client.responses.create(
            model=MODEL,
            input="What is the weather in Paris?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=40,
            temperature=0,
        )
        call = next(i for i in called.output if i.type == "function_call")
        answered = await client.responses.create(
            model=MODEL,
            previous_response_id=called.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}],
            tools=[WEATHER],
            max_output_tokens=8,
        )
        return called, call, answered

    called, call, answered = _client_run(app, scenario)
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert answered.status in ("completed", "incomplete")
    assert answered.usage.input_tokens_details.cached_tokens >= called.usage.input_tokens


def test_text_format_and_limits(app):
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }

    async def scenario(client, http):  # noqa: ANN001, ANN202
        shaped = await client.responses.create(
            model=MODEL,
            input="Pick a colour.",
            text={"format": {"type": "json_schema", "name": "pick", "schema": schema}},
            max_output_tokens=24,
        )
        cut = await client.responses.create(model=MODEL, input="Tell a story.", max_output_tokens=3)
        refused = await http.post(
            "/v1/responses",
            json={"model": MODEL, "input": "Hi", "tools": [{"type": "web_search"}]},
        )
        unknown = await http.post("/v1/responses", json={"input": "Hi", "nope": 1})
        image = [{"type": "input_image", "image_url": "http://x/y.png"}]
        unsupported = [
            await http.post("/v1/responses", json={"input": "Hi", "reasoning": {"effort": "low"}}),
            await http.post("/v1/responses", json={"input": [{"role": "user", "content": image}]}),
        ]
        raw = await http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2})
        text_events = await _raw_events(http, {"input": "Hi", "max_output_tokens": 3})
        call_events = await _raw_events(
            http,
            {
                "input": "Weather in Paris?",
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "name": "get_weather"},
                "max_output_tokens": 40,
                "temperature": 0,
            },
        )
        return shaped, cut, refused, unknown, unsupported, raw.json(), text_events, call_events

    shaped, cut, refused, unknown, unsupported, raw, text_events, call_events = _client_run(
        app, scenario
    )
    jsonschema.validate(json.loads(shaped.output_text), schema)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    assert unknown.status_code == 400 and "nope" in unknown.json()["error"]["message"]
    assert [r.status_code for r in unsupported] == [400, 400]
    assert unsupported[0].json()["error"]["param"] == "reasoning"
    assert "image input is not supported" in unsupported[1].json()["error"]["message"]
    Response.model_validate(raw)
    assert text_events[-1]["type"] == "response.incomplete"
    kinds = [e["type"] for e in call_events]
    assert kinds[2] == "response.output_item.added" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    assert "response.output_text.delta" not in kinds
    arguments = next(e for e in call_events if e["type"] == "response.output_item.done")
    assert json.loads(arguments["item"]["arguments"]) == {"city": "Paris"}
