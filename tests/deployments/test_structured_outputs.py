"""Structured outputs and tool calls through OpenAI's routes in-process, with the
official openai client: every constrained output parses, every forced call is a call."""

import asyncio
import json
import re

import openai
import pytest
from pydantic import BaseModel, Field

from tests.local_app import MODEL, http_client, run

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
        },
    },
}


class Person(BaseModel):
    """maxLength is in the schema, so the grammar bounds each string too."""

    name: str = Field(max_length=60)
    age: int
    city: str = Field(max_length=60)


async def _with_client(fn):  # noqa: ANN001, ANN202
    async with http_client(app_of[0]) as http:
        client = openai.AsyncOpenAI(base_url="http://localhost/v1", api_key="x", http_client=http)
        return await fn(client)


app_of: list = []


@pytest.fixture(autouse=True)
def _app(app):  # noqa: ANN001, ANN202
    app_of[:] = [app]


def test_parse_with_a_pydantic_model_greedy_and_sampled():
    prompts = [
        "Describe a person who lives in Paris.",
        "Invent a character for a novel.",
        "Who is your favourite scientist?",
        "Tell me about a chef from Rome.",
        "Make up a football player.",
        "A teacher in a small village.",
        "Write about an astronaut.",
        "Who painted the Mona Lisa?",
        "Create a villain for a film.",
        "Someone who runs a bakery in Lyon.",
        "A musician from New Orleans.",
        "Describe your neighbour.",
        "An old sailor.",
        "A student who loves chess.",
        "The mayor of a big city.",
        "A doctor working at night.",
        "Invent a detective.",
        "A farmer in Kansas.",
        "Someone born in 1990.",
        "Tell me about a programmer.",
    ]

    async def scenario(client):  # noqa: ANN001, ANN202
        # All at once: the engine batches them, each under its own grammar.
        return await asyncio.gather(
            *(
                client.beta.chat.completions.parse(
                    model=MODEL,
                    messages=[{"role": "user", "content": prompt}],
                    response_format=Person,
                    max_tokens=200,
                    temperature=temperature,
                    seed=i,
                )
                for i, prompt in enumerate(prompts)
                for temperature in (0.0, 1.0)
            )
        )

    for completion in run(_with_client(scenario)):
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Person)


def test_json_object_regex_choice_and_grammar():
    async def scenario(client):  # noqa: ANN001, ANN202
        ask = [{"role": "user", "content": "Give me a cat's name and colour as JSON."}]
        create = client.chat.completions.create
        obj = await create(
            model=MODEL,
            messages=ask,
            response_format={"type": "json_object"},
            max_tokens=300,
            temperature=0,
        )
        phone = await create(
            model=MODEL,
            messages=[{"role": "user", "content": "A phone number?"}],
            extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"},
            max_tokens=20,
        )
        choice = await create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is the sky blue?"}],
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
            max_tokens=5,
            n=3,
        )
        gbnf = await client.completions.create(
            model=MODEL,
            prompt="Count: ",
            max_tokens=30,
            extra_body={
                "guided_grammar": 'root ::= "one" (", " item){1,3} "." \nitem ::= "two" | "three"'
            },
        )
        return obj, phone, choice, gbnf

    obj, phone, choice, gbnf = run(_with_client(scenario))
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.choices[0].message.content)
    assert {c.message.content for c in choice.choices} <= {"yes", "no"}
    assert re.fullmatch(r"one(, (two|three)){1,3}\.", gbnf.choices[0].text)


def test_bad_schemas_and_grammars_are_400s():
    async def scenario(client):  # noqa: ANN001, ANN202
        create = client.chat.completions.create
        ask = [{"role": "user", "content": "hi"}]
        errors = []
        for extra in (
            {"guided_regex": "("},
            {"guided_grammar": "root ::= missing"},
            {"guided_json": {"type": "nonsense"}},
            {"guided_choice": []},
            {"guided_json": {"type": "object"}, "guided_regex": "a"},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        ):
            with pytest.raises(openai.BadRequestError) as exc:
                await create(model=MODEL, messages=ask, max_tokens=4, extra_body=extra)
            errors.append(exc.value.body)
        return errors

    for body in run(_with_client(scenario)):
        assert body["message"], body


def test_forced_tool_calls_whole_and_streamed():
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]

    forced = {
        "model": MODEL,
        "messages": ask,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "max_tokens": 120,
        "temperature": 0,
        "parallel_tool_calls": False,
    }
    get_time = {"type": "function", "function": {"name": "get_time"}}

    async def scenario(client):  # noqa: ANN001, ANN202
        create = client.chat.completions.create
        required = await create(**forced)
        named = await create(**forced | {"tool_choice": get_time})
        async with client.chat.completions.stream(**forced) as sdk_stream:
            reassembled = await sdk_stream.get_final_completion()
        chunks = [chunk async for chunk in await create(**forced, stream=True)]
        return required, named, chunks, reassembled

    required, named, chunks, reassembled = run(_with_client(scenario))
    call = required.choices[0].message.tool_calls[0]
    assert required.choices[0].finish_reason == "tool_calls"
    assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city", "unit"} if call.function.name == "get_weather" else {"timezone"})
    named_call = named.choices[0].message.tool_calls[0]
    assert named_call.function.name == "get_time"
    assert "timezone" in json.loads(named_call.function.arguments)
    # Streamed: the first piece of the call has its id and name, later ones argument text.
    pieces = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == call.function.name
    # (pieces: one message's tokens, merged by the replica's pacing)
    assert len(pieces) >= 2 and all(p.index == 0 for p in pieces)
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The SDK's own stream helper puts the call back together.
    (sdk_call,) = reassembled.choices[0].message.tool_calls
    assert sdk_call.function.name == call.function.name
    assert sdk_call.function.arguments == call.function.arguments
    assert sdk_call.function.parsed_arguments is None or isinstance(
        sdk_call.function.parsed_arguments, dict
    )


def test_a_multi_turn_exchange_with_a_tool_result():
    async def scenario(client):  # noqa: ANN001, ANN202
        create = client.chat.completions.create
        messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
        first = await create(
            model=MODEL,
            messages=messages,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=80,
            temperature=0,
        )
        call = first.choices[0].message.tool_calls[0]
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'})
        second = await create(
            model=MODEL, messages=messages, tools=[WEATHER], max_tokens=40, temperature=0
        )
        bad = [
            *messages[:1],
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": "{"},
                    }
                ],
            },
        ]
        with pytest.raises(openai.BadRequestError):
            await create(model=MODEL, messages=bad, max_tokens=4)
        return second

    second = run(_with_client(scenario))
    assert second.choices[0].message.content or second.choices[0].message.tool_calls


def test_stop_strings_cut_a_constrained_output():
    async def scenario(client):  # noqa: ANN001, ANN202
        return await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Two colours?"}],
            extra_body={"guided_regex": "(red|blue|green), (red|blue|green)"},
            stop=[","],
            max_tokens=10,
            temperature=0,
        )

    out = run(_with_client(scenario)).choices[0]
    assert out.message.content in ("red", "blue", "green") and out.finish_reason == "stop"


def test_llamacpp_completion_json_schema_and_grammar():
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }

    async def scenario():  # noqa: ANN202
        async with http_client(app_of[0]) as http:
            as_json = await http.post(
                "/completion",
                json={
                    "prompt": "2 + 2 =",
                    "n_predict": 20,
                    "temperature": 0,
                    "json_schema": schema,
                },
            )
            gbnf = await http.post(
                "/completion",
                json={"prompt": "Pick:", "n_predict": 10, "grammar": 'root ::= "A" | "B" | "C"'},
            )
            bad = await http.post("/completion", json={"prompt": "x", "grammar": "root ::= ("})
            both = await http.post(
                "/completion", json={"prompt": "x", "grammar": 'root ::= "A"', "json_schema": {}}
            )
            return as_json, gbnf, bad, both

    as_json, gbnf, bad, both = run(scenario())
    assert set(json.loads(as_json.json()["content"])) == {"answer"}
    assert gbnf.json()["content"] in ("A", "B", "C")
    assert bad.status_code == 400 and "grammar" in bad.json()["error"]["message"]
    assert both.status_code == 400


def test_tools_whose_grammar_is_too_large_are_the_clients_400():
    """128 tools of 50 enum parameters (1.1 MB of JSON, under the body limit): their
    calls' grammar is over the constraint limit. Told in the dialect's shape, before
    any rendering or model work (before, a 500)."""
    props = {f"p{j}": {"type": "string", "enum": [f"v{k}" for k in range(20)]} for j in range(50)}
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "parameters": {"type": "object", "properties": props, "required": list(props)},
            },
        }
        for i in range(128)
    ]

    async def scenario(client):  # noqa: ANN001, ANN202
        outcomes = []
        for choice in ("required", "auto"):
            try:
                await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "hi"}],
                    tools=tools,
                    tool_choice=choice,
                    max_tokens=4,
                )
            except openai.BadRequestError as exc:
                outcomes.append(exc.body)
        return outcomes

    outcomes = run(_with_client(scenario))
    assert len(outcomes) == 2
    for body in outcomes:
        assert body["param"] == "tools" and "too large" in body["message"], body
