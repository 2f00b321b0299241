"""Structured outputs and tools through the live Serve app, with the clients people use:
the `ollama` client's `format` and `tools`, and a LangChain agent loop over its
OpenAI-compatible chat class (one tool call, end to end)."""

import json

import ollama
import pytest
from pydantic import BaseModel

from tests.serve.conftest import MODEL


class Pet(BaseModel):
    name: str
    species: str
    age: int


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: The city's name
    """
    return json.dumps({"city": city, "temperature_c": 18, "sky": "sunny"})


@pytest.fixture(scope="module")
def ollama_client(base_url):
    return ollama.Client(host=base_url, timeout=120)


def test_ollama_format_json_and_schema(ollama_client):
    asked = [{"role": "user", "content": "Describe a pet as JSON."}]
    options = {"temperature": 0, "num_predict": 200}
    schema = ollama_client.chat(
        model=MODEL, messages=asked, format=Pet.model_json_schema(), options=options
    )
    assert Pet.model_validate_json(schema.message.content)
    free = ollama_client.generate(
        model=MODEL, prompt="A cat as JSON:", format="json", options=options
    )
    assert isinstance(json.loads(free.response), dict)
    streamed = "".join(
        part.message.content
        for part in ollama_client.chat(
            model=MODEL,
            messages=asked,
            format=Pet.model_json_schema(),
            options=options,
            stream=True,
        )
    )
    assert streamed == schema.message.content


def _earlier_call(city: str, temperature: int) -> list[dict]:
    """One earlier exchange: a question, the model's call, the tool's answer, the reply."""
    call = {"function": {"name": "get_weather", "arguments": {"city": city}}}
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {
            "role": "tool",
            "content": json.dumps({"temperature_c": temperature}),
            "tool_name": "get_weather",
        },
        {"role": "assistant", "content": f"It is {temperature} degrees in {city}."},
    ]


def test_ollama_tools_and_a_tool_result(ollama_client):
    """Ollama has no tool_choice: the model decides. SmolLM2-135M, shown two earlier calls
    and asked greedily, calls the tool; the call comes back with arguments as an object,
    whole and streamed; asked plainly, it answers in text."""
    messages = [
        *_earlier_call("Rome", 25),
        *_earlier_call("Berlin", 12),
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    options = {"temperature": 0, "num_predict": 120}
    first = ollama_client.chat(model=MODEL, messages=messages, tools=[get_weather], options=options)
    calls = first.message.tool_calls or []
    assert calls and calls[0].function.name == "get_weather", first.message
    assert calls[0].function.arguments == {"city": "Paris"}
    streamed = [
        c
        for part in ollama_client.chat(
            model=MODEL, messages=messages, tools=[get_weather], options=options, stream=True
        )
        for c in part.message.tool_calls or []
    ]
    assert [c.function for c in streamed] == [c.function for c in calls]
    messages.append(first.message)
    result = get_weather(**calls[0].function.arguments)
    messages.append({"role": "tool", "content": result, "tool_name": "get_weather"})
    second = ollama_client.chat(
        model=MODEL, messages=messages, tools=[get_weather], options=options
    )
    assert second.done and (second.message.content or second.message.tool_calls)
    plain = ollama_client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=[get_weather],
        options=options,
    )
    assert plain.message.content and not plain.message.tool_calls


def test_langchain_agent_loop_makes_one_tool_call(base_url):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    weather = tool(get_weather)
    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{base_url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=120,
        max_retries=0,
    )
    agent = llm.bind_tools([weather], tool_choice="get_weather")
    messages = [HumanMessage("What is the weather in Paris?")]
    reply = agent.invoke(messages)
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    messages.append(reply)
    for call in reply.tool_calls:
        messages.append(ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"]))
    final = llm.bind_tools([weather]).invoke(messages)
    assert final.content or final.tool_calls
