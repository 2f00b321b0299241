"""Anthropic's Messages API in-process, with the official anthropic SDK: whole and
streamed replies, token counts, stop sequences, prefills, forced tool use and a tool
result round trip, and errors in Anthropic's shape."""

import json

import anthropic
import httpx2
import jsonschema
import pytest

from deployments.api.anthropic.schema import MessagesRequest
from deployments.config import AppConfig
from tests.local_app import MODEL, http_client, local_app, run

ASK = [{"role": "user", "content": "Name three colours."}]
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _with_client(app, scenario, key: str = "x"):  # noqa: ANN001, ANN202
    """Run `scenario(client)` with the official SDK over the in-process app."""

    async def go():  # noqa: ANN202
        # anthropic 2 speaks through httpx2 (httpx's successor), with its own ASGI transport.
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://localhost") as http:
            client = anthropic.AsyncAnthropic(
                base_url="http://localhost", api_key=key, http_client=http
            )
            return await scenario(client)

    return run(go())


def test_create_counts_and_stops(app):
    async def scenario(client):  # noqa: ANN001, ANN202
        create = client.messages.create
        whole = await create(
            model=MODEL, max_tokens=12, messages=ASK, extra_body={"temperature": 0}
        )
        count = client.messages.count_tokens
        counted = await count(model=MODEL, messages=ASK)
        system_text = await count(model=MODEL, messages=ASK, system="Be brief.")
        system_blocks = await count(
            model=MODEL, messages=ASK, system=[{"type": "text", "text": "Be brief."}]
        )
        # Fields that leave the prompt as it is (the SDK may send them here too).
        hinted = await count(
            model=MODEL,
            messages=ASK,
            cache_control={"type": "ephemeral"},
            output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
        )
        counts = [c.input_tokens for c in (counted, system_text, system_blocks, hinted)]
        short = await create(
            model=MODEL,
            max_tokens=5,
            messages=ASK,
            extra_body={"temperature": 0},
            diagnostics={"previous_message_id": whole.id},  # accepted, not reported on
        )
        word = whole.content[0].text.split()[1]
        stopped = await create(
            model=MODEL,
            max_tokens=12,
            messages=ASK,
            extra_body={"temperature": 0},
            stop_sequences=[word],
        )
        return whole, counts, short, word, stopped

    whole, counts, short, word, stopped = _with_client(app, scenario)
    assert whole.content[0].type == "text" and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.id.startswith("msg_")
    usage = whole.usage
    # Anthropic's input_tokens leaves out the prompt tokens read from the cache.
    assert usage.input_tokens + usage.cache_read_input_tokens == counts[0]
    assert usage.cache_creation_input_tokens == 0
    plain, system_text, system_blocks, hinted = counts
    # (SmolLM2's template has a default system prompt: a given one replaces it.)
    assert system_text == system_blocks != plain == hinted
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 5
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == whole.content[0].text[: len(stopped.content[0].text)]
    assert word not in stopped.content[0].text


def test_stream_matches_whole_reply(app):
    async def scenario(client):  # noqa: ANN001, ANN202
        whole = await client.messages.create(
            model=MODEL, max_tokens=10, messages=ASK, extra_body={"temperature": 0}
        )
        async with client.messages.stream(
            model=MODEL, max_tokens=10, messages=ASK, extra_body={"temperature": 0}
        ) as stream:
            pieces = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        async with http_client(app) as http:
            body = {"model": MODEL, "max_tokens": 4, "messages": ASK, "stream": True}
            async with http.stream("POST", "/v1/messages", json=body) as response:
                text = "".join([piece async for piece in response.aiter_text()])
        return whole, "".join(pieces), final, text

    whole, streamed, final, raw = _with_client(app, scenario)
    assert streamed == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.id.startswith("msg_")
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = []
    for frame in raw.strip().split("\n\n"):
        name, data = frame.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {events[-1]['type']}"
    kinds = [e["type"] for e in events]
    deltas = len(kinds) - 6
    assert deltas >= 1
    assert kinds == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["usage"]["input_tokens"]
    assert events[1]["content_block"] == {"type": "text", "text": ""}
    assert events[3]["delta"]["type"] == "text_delta"
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2]["usage"]["output_tokens"] == 4


def test_prefill_is_continued(app):
    async def scenario(client):  # noqa: ANN001, ANN202
        messages = [*ASK, {"role": "assistant", "content": "Red, green and"}]
        reply = await client.messages.create(
            model=MODEL, max_tokens=4, messages=messages, extra_body={"temperature": 0}
        )
        count = client.messages.count_tokens
        counted = await count(model=MODEL, messages=messages)
        plain = await count(model=MODEL, messages=ASK)
        empty = await count(model=MODEL, messages=[*ASK, {"role": "assistant", "content": ""}])
        return reply, counted.input_tokens, plain.input_tokens, empty.input_tokens

    reply, counted, plain, empty = _with_client(app, scenario)
    assert reply.content[0].text and not reply.content[0].text.startswith("Red, green")
    # The prefill's tokens are in the prompt, with no end of turn after them; an empty
    # one leaves the prompt as the plain request's.
    assert counted > plain == empty


def test_forced_tool_use_and_a_result_round_trip(app):
    async def scenario(client):  # noqa: ANN001, ANN202
        asked = [{"role": "user", "content": "What is the weather in Paris?"}]
        used = await client.messages.create(
            model=MODEL,
            max_tokens=40,
            messages=asked,
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body={"temperature": 0},
        )
        call = next(b for b in used.content if b.type == "tool_use")
        follow = [
            *asked,
            {"role": "assistant", "content": [b.model_dump() for b in used.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C"}],
            },
        ]
        answer = await client.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=follow,
            tools=[WEATHER],
            extra_body={"temperature": 0},
        )
        async with client.messages.stream(
            model=MODEL,
            max_tokens=40,
            messages=asked,
            tools=[WEATHER],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            extra_body={"temperature": 0},
        ) as stream:
            streamed = await stream.get_final_message()
        return used, call, answer, streamed

    used, call, answer, streamed = _with_client(app, scenario)
    assert used.stop_reason == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    streamed_call = next(b for b in streamed.content if b.type == "tool_use")
    assert streamed.stop_reason == "tool_use" and streamed_call.input == call.input


def test_errors_in_anthropics_shape(app):
    async def scenario(client):  # noqa: ANN001, ANN202
        errors = {}
        for name, kwargs in [
            ("unknown model", {"model": "no-such", "messages": ASK}),
            ("image", {"messages": [{"role": "user", "content": [IMAGE]}]}),
            ("thinking", {"messages": ASK, "thinking": {"type": "sometimes"}}),
        ]:
            try:
                await client.messages.create(**{"model": MODEL, "max_tokens": 4, **kwargs})
            except anthropic.APIStatusError as exc:
                errors[name] = exc
        bodies = {
            "max_tokens": {"model": MODEL, "messages": ASK},
            "top_n": {"model": MODEL, "max_tokens": 4, "messages": ASK, "top_n": 2},
            "messages": {"model": MODEL, "max_tokens": 4, "messages": []},
            "text block": {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}],
            },
        }
        async with http_client(app) as http:
            raw = {k: await http.post("/v1/messages", json=b) for k, b in bodies.items()}
        return errors, raw

    # A name that is no served model's is a 404 with strict_model_names (otherwise, with
    # one model served, any name means it, as clients hard-code claude-* names).
    ingress = app.state.ingress
    config = ingress.config
    ingress.config = config.model_copy(update={"strict_model_names": True})

    try:
        errors, raw = _with_client(app, scenario)
    finally:
        ingress.config = config
    assert isinstance(errors["unknown model"], anthropic.NotFoundError)
    assert isinstance(errors["image"], anthropic.BadRequestError)
    assert "does not read images" in errors["image"].body["error"]["message"]
    assert isinstance(errors["thinking"], anthropic.BadRequestError)
    for field, response in raw.items():  # each 400 names the field at fault
        body = response.json()
        assert response.status_code == 400, body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert field in body["error"]["message"]


def test_thinking_accepted(app):
    """`thinking` is accepted (the model does not reason first: the reply is text), and
    an earlier turn's thinking blocks reach the template as reasoning_content."""
    history = [
        {"role": "user", "content": "What is 2+2?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Two and two.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "4"},
            ],
        },
        {"role": "user", "content": "And 3+3?"},
    ]
    thinking = {"type": "enabled", "budget_tokens": 1024}

    async def scenario(client):  # noqa: ANN001, ANN202
        return await client.messages.create(
            model=MODEL, max_tokens=4, messages=history, thinking=thinking
        )

    reply = _with_client(app, scenario)
    assert reply.content and all(b.type == "text" for b in reply.content)
    messages = MessagesRequest.model_validate(
        {"max_tokens": 4, "messages": history, "thinking": thinking}
    ).template_messages()
    assert messages[1] == {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}


def test_x_api_key(smollm2_engine, tmp_path):
    config = AppConfig.model_validate(
        {
            "api_keys": ["sk-ant-test"],
            "embeddings": {"enabled": False},
            "assistants": {"database_path": str(tmp_path / "a.sqlite3")},
            "models": [{"name": MODEL}],
        }
    )

    async def call(client):  # noqa: ANN001, ANN202
        return await client.messages.count_tokens(model=MODEL, messages=ASK)

    with local_app(config, smollm2_engine) as (app, _):
        good = _with_client(app, call, key="sk-ant-test")
        with pytest.raises(anthropic.AuthenticationError) as refused:
            _with_client(app, call, key="sk-wrong")
    assert good.input_tokens > 0
    error = refused.value
    assert error.status_code == 401 and error.body["error"]["type"] == "authentication_error"


def test_output_format_constrains_the_reply(app):
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }

    async def scenario(client):  # noqa: ANN001, ANN202
        return await client.messages.create(
            model=MODEL,
            max_tokens=24,
            messages=ASK,
            output_config={"format": {"type": "json_schema", "schema": schema}},
        )

    reply = _with_client(app, scenario)
    jsonschema.validate(json.loads(reply.content[0].text), schema)
    assert reply.stop_reason == "end_turn"
