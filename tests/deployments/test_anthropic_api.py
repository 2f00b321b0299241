"""Anthropic's Messages API in-process, with the official anthropic SDK: whole and
streamed replies, token counts, stop sequences, prefills, forced tool use and a tool
result round trip, and errors in Anthropic's shape."""

import json

import anthropic
import httpx2
import jsonschema
import pytest

from deployments.config import AppConfig
from tests.local_app import MODEL, http_client, local_app, run

ASK = [{"role": "user", "content": "Name three colours."}]
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


async def _with_client(app, fn, key: str = "x"):  # noqa: ANN001, ANN202
    # anthropic 2 speaks through httpx2 (httpx's successor), which has its own ASGI transport.
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://local") as http:
        client = anthropic.AsyncAnthropic(base_url="http://local", api_key=key, http_client=http)
        return await fn(client)


def test_create_counts_and_stops(app):
    async def scenario(client):  # noqa: ANN001, ANN202
        create = client.messages.create
        whole = await create(
            model=MODEL, max_tokens=12, messages=ASK, extra_body={"temperature": 0}
        )
        counted = await client.messages.count_tokens(model=MODEL, messages=ASK)
        system = await client.messages.count_tokens(
            model=MODEL, messages=ASK, system=[{"type": "text", "text": "Be brief."}]
        )
        short = await create(model=MODEL, max_tokens=3, messages=ASK, extra_body={"temperature": 0})
        word = whole.content[0].text.split()[1]
        stopped = await create(
            model=MODEL,
            max_tokens=12,
            messages=ASK,
            extra_body={"temperature": 0},
            stop_sequences=[word],
        )
        return whole, counted, system, short, word, stopped

    whole, counted, system, short, word, stopped = run(_with_client_app(scenario))
    assert whole.content[0].type == "text" and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.id.startswith("msg_")
    usage = whole.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens
    assert system.input_tokens != counted.input_tokens
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
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
        async with http_client(app_of[0]) as http:
            body = {"model": MODEL, "max_tokens": 4, "messages": ASK, "stream": True}
            async with http.stream("POST", "/v1/messages", json=body) as response:
                lines = [line async for line in response.aiter_lines()]
        return whole, "".join(pieces), final, lines

    whole, streamed, final, lines = run(_with_client_app(scenario))
    assert streamed == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = [line[7:] for line in lines if line.startswith("event: ")]
    assert events[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_prefill_is_continued(app):
    async def scenario(client):  # noqa: ANN001, ANN202
        messages = [*ASK, {"role": "assistant", "content": "Red, green and"}]
        reply = await client.messages.create(
            model=MODEL, max_tokens=4, messages=messages, extra_body={"temperature": 0}
        )
        counted = await client.messages.count_tokens(model=MODEL, messages=messages)
        plain = await client.messages.count_tokens(model=MODEL, messages=ASK)
        return reply, counted, plain

    reply, counted, plain = run(_with_client_app(scenario))
    assert reply.content[0].text
    # The prefill's tokens are in the prompt, with no end of turn after them.
    assert counted.input_tokens > plain.input_tokens


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

    used, call, answer, streamed = run(_with_client_app(scenario))
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
            ("unknown model", {"model": "no-such", "max_tokens": 4, "messages": ASK}),
            (
                "image",
                {
                    "model": MODEL,
                    "max_tokens": 4,
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {
                                    "type": "image",
                                    "source": {
                                        "type": "base64",
                                        "media_type": "image/png",
                                        "data": "AA",
                                    },
                                }
                            ],
                        }
                    ],
                },
            ),
            (
                "thinking",
                {
                    "model": MODEL,
                    "max_tokens": 4,
                    "messages": ASK,
                    "thinking": {"type": "enabled", "budget_tokens": 1024},
                },
            ),
        ]:
            try:
                await client.messages.create(**kwargs)
            except anthropic.APIStatusError as exc:
                errors[name] = exc
        async with http_client(app_of[0]) as http:
            raw = await http.post("/v1/messages", json={"model": MODEL, "messages": ASK})
        return errors, raw

    # A name that is no served model's is a 404 with strict_model_names (otherwise, with
    # one model served, any name means it, as clients hard-code claude-* names).
    ingress = app.state.ingress
    config = ingress.config
    ingress.config = config.model_copy(update={"strict_model_names": True})

    try:
        errors, raw = run(_with_client_app(scenario))
    finally:
        ingress.config = config
    assert isinstance(errors["unknown model"], anthropic.NotFoundError)
    assert isinstance(errors["image"], anthropic.BadRequestError)
    assert isinstance(errors["thinking"], anthropic.BadRequestError)
    assert raw.status_code == 400
    body = raw.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


def test_x_api_key(smollm2_engine, tmp_path):
    config = AppConfig.model_validate(
        {
            "api_keys": ["sk-ant-test"],
            "embeddings": {"enabled": False},
            "assistants": {"database_path": str(tmp_path / "a.sqlite3")},
            "models": [{"name": MODEL}],
        }
    )

    async def scenario(app):  # noqa: ANN001, ANN202
        async def call(client):  # noqa: ANN001, ANN202
            return await client.messages.count_tokens(model=MODEL, messages=ASK)

        good = await _with_client(app, call, key="sk-ant-test")
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await _with_client(app, call, key="sk-wrong")
        return good, refused.value

    with local_app(config, smollm2_engine) as (app, _):
        good, refused = run(scenario(app))
    assert good.input_tokens > 0
    assert refused.status_code == 401 and refused.body["error"]["type"] == "authentication_error"


app_of: list = []


@pytest.fixture(autouse=True)
def _app(request):  # noqa: ANN001, ANN202
    if "app" in request.fixturenames:
        app_of[:] = [request.getfixturevalue("app")]
    yield
    app_of.clear()


def _with_client_app(fn):  # noqa: ANN001, ANN202
    return _with_client(app_of[0], fn)


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

    reply = run(_with_client_app(scenario))
    jsonschema.validate(json.loads(reply.content[0].text), schema)
    assert reply.stop_reason == "end_turn"
