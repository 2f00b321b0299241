"""OpenAI's Responses API in-process, with the official openai SDK: whole and streamed
replies, instructions, previous_response_id chains kept warm in a context, stored
responses, function tools and text formats."""

import json

import jsonschema
import openai
import pytest

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


def _client_run(app, fn):  # noqa: ANN001, ANN202
    async def scenario():
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(base_url="http://local/v1", api_key="x", http_client=http)
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
        second = await create(
            model=MODEL,
            input="What is my name?",
            previous_response_id=first.id,
            max_output_tokens=12,
        )
        third = await create(
            model=MODEL,
            input="And what do I like?",
            previous_response_id=second.id,
            max_output_tokens=12,
        )
        got = await client.responses.retrieve(second.id)
        items = await client.responses.input_items.list(second.id)
        await client.responses.delete(third.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(third.id)
        with pytest.raises(openai.NotFoundError):
            await create(model=MODEL, input="Hi", previous_response_id="resp_nope")
        alone = await create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(alone.id)
        return first, second, third, got, items

    first, second, third, got, items = _client_run(app, scenario)
    # Each turn's prompt holds the whole conversation so far...
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    # ...and the chain's context held all of it but the new turn.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens
    assert third.previous_response_id == second.id
    assert got.id == second.id and got.output_text == second.output_text
    assert [i.content[0].text for i in items.data] == ["What is my name?"]


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
    assert answered.usage.input_tokens_details.cached_tokens > 0


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
        return shaped, cut, refused, unknown

    shaped, cut, refused, unknown = _client_run(app, scenario)
    jsonschema.validate(json.loads(shaped.output_text), schema)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    assert unknown.status_code == 400 and "nope" in unknown.json()["error"]["message"]
