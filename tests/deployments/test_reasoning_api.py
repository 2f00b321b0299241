"""A reasoning model's thinking apart from its answer, in every dialect, through the
official clients, in-process over the real default model.

The model's template is overridden from a file, in the shape of a Qwen3 thinking model's:
its generation prompt opens the thinking block (`<think>\\n`), or, with
`enable_thinking: false`, writes an empty one. The parser is `auto` (the template's
`<think>` picks the markers; the prompt's end says the output starts inside). So what
the model writes after an open block is thinking until it writes `</think>`; and with
earlier turns that show it the pattern, SmolLM2 writes the markers itself (greedy),
which splits the output into thinking and answer for real.
"""

import json

import anthropic
import httpx
import httpx2
import ollama
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from deployments.config import AppConfig
from tests.local_app import MODEL, http_client, local_app, run

TEMPLATE = (
    "{% if messages[0].role == 'system' and messages[0].content == 'fail' %}"
    "{{ raise_exception('this template takes no such system prompt') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "What is 2+2?"}]
THOUGHT = "The user wants a greeting.\n"
# Two earlier turns that think, then answer: the model copies the pattern.
SHOWN = [
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": f"<think>\n{THOUGHT}</think>\n\nHi!"},
] * 2 + [{"role": "user", "content": "Say hi."}]
GREEDY = {"max_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def app(smollm2_engine, tmp_path_factory):
    state = tmp_path_factory.mktemp("reasoning")
    template_file = state / "thinking.jinja"
    template_file.write_text(TEMPLATE)
    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "assistants": {"database_path": str(state / "assistants.sqlite3")},
            "models": [{"name": MODEL, "chat_template": str(template_file)}],
        }
    )
    with local_app(config, smollm2_engine) as (app, _):
        yield app


def _openai(app, scenario):  # noqa: ANN001, ANN202
    async def go():  # noqa: ANN202
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http
            )
            return await scenario(client, http)

    return run(go())


async def _raw(http, smollm2_tokenizer, prompt: str, max_tokens: int = 16) -> dict:  # noqa: ANN001
    """The model's own text after `prompt` (greedy), with no splitting."""
    ids = smollm2_tokenizer(prompt, add_special_tokens=False).input_ids
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    return (await http.post("/v1/completions", json=body)).json()


def test_the_models_template_comes_from_its_file_and_thinking_is_a_switch(app, smollm2_tokenizer):
    async def scenario(client, http):  # noqa: ANN001, ANN202
        create = client.chat.completions.create
        opened = (await http.post("/apply-template", json={"messages": ASK})).json()["prompt"]
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        closed = (await http.post("/apply-template", json={"messages": ASK, **off})).json()
        show = (await http.post("/api/show", json={"model": MODEL})).json()
        thinking = await create(model=MODEL, messages=ASK, **GREEDY)
        answering = await create(model=MODEL, messages=ASK, extra_body=off, **GREEDY)
        raw_open = await _raw(http, smollm2_tokenizer, opened)
        raw_closed = await _raw(http, smollm2_tokenizer, closed["prompt"])
        return opened, closed["prompt"], show, thinking, answering, raw_open, raw_closed

    opened, closed, show, thinking, answering, raw_open, raw_closed = _openai(app, scenario)
    assert opened.endswith("<|im_start|>assistant\n<think>\n")
    assert closed.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert show["template"] == TEMPLATE and "thinking" in show["capabilities"]
    # The block was open: everything the model wrote is thinking, none of it answer.
    message = thinking.choices[0].message
    assert "</think>" not in raw_open["choices"][0]["text"]
    assert message.reasoning_content == raw_open["choices"][0]["text"] != ""
    assert message.content == ""
    usage = thinking.usage
    assert usage.completion_tokens == raw_open["usage"]["completion_tokens"]
    assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens
    # Thinking off: the template closed the block, and the output is all answer.
    message = answering.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content == raw_closed["choices"][0]["text"] != ""


def test_markers_the_model_writes_split_whole_and_streamed(app, smollm2_tokenizer):
    async def scenario(client, http):  # noqa: ANN001, ANN202
        create = client.chat.completions.create
        whole = await create(model=MODEL, messages=SHOWN, **GREEDY)
        prompt = (await http.post("/apply-template", json={"messages": SHOWN})).json()["prompt"]
        raw = await _raw(http, smollm2_tokenizer, prompt)
        deltas = []
        async for chunk in await create(model=MODEL, messages=SHOWN, stream=True, **GREEDY):
            deltas += [c.delta for c in chunk.choices]
        # Stop strings see the answer only: "user" is in the thinking, "!" in the answer.
        past = await create(model=MODEL, messages=SHOWN, stop=["user"], **GREEDY)
        cut = await create(model=MODEL, messages=SHOWN, stop=["!"], **GREEDY)
        # A constraint governs the answer after free thinking.
        choice = {"guided_choice": ["Hello!", "Bye!"]}
        chosen = await create(model=MODEL, messages=SHOWN, extra_body=choice, **GREEDY)
        return whole, raw, deltas, past, cut, chosen

    whole, raw, deltas, past, cut, chosen = _openai(app, scenario)
    assert raw["choices"][0]["text"].startswith(f"{THOUGHT}</think>\n\nHi!")  # the model's own
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, "Hi!")
    thinking = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (thinking, content) == (THOUGHT, "Hi!")
    assert not any(getattr(d, "reasoning_content", None) and d.content for d in deltas)
    assert past.choices[0].message.content == "Hi!" and past.choices[0].finish_reason == "stop"
    cut_message = cut.choices[0].message
    assert (cut_message.reasoning_content, cut_message.content) == (THOUGHT, "Hi")
    chosen_message = chosen.choices[0].message
    assert chosen_message.reasoning_content == THOUGHT
    assert chosen_message.content in ("Hello!", "Bye!")


def test_ollama_client_think_on_and_off(app):
    async def scenario():  # noqa: ANN202
        transport = httpx.ASGITransport(app=app)
        client = ollama.AsyncClient(host="http://localhost", transport=transport)
        greedy = {"temperature": 0, "num_predict": 16, "repeat_penalty": 1.0}
        on = await client.chat(MODEL, messages=SHOWN, think=True, options=greedy)
        off = await client.chat(MODEL, messages=ASK, think=False, options=greedy)
        pieces = [
            p
            async for p in await client.chat(
                MODEL, messages=SHOWN, think=True, options=greedy, stream=True
            )
        ]
        generated = await client.generate(MODEL, "What is 2+2?", think=True, options=greedy)
        gen_off = await client.generate(MODEL, "What is 2+2?", think=False, options=greedy)
        return on, off, pieces, generated, gen_off

    on, off, pieces, generated, gen_off = run(scenario())
    assert (on.message.thinking, on.message.content) == (THOUGHT, "Hi!")
    assert off.message.thinking is None and off.message.content
    thinking = "".join(p.message.thinking or "" for p in pieces)
    assert (thinking, "".join(p.message.content for p in pieces)) == (THOUGHT, "Hi!")
    assert pieces[-1].done and not any(p.message.thinking and p.message.content for p in pieces)
    assert generated.thinking and generated.response == ""  # the open block: all thinking
    assert gen_off.thinking is None and gen_off.response
    # think=false closed the block in the prompt: more prompt tokens, none of them thought.
    assert gen_off.prompt_eval_count > generated.prompt_eval_count


def _anthropic(app, scenario):  # noqa: ANN001, ANN202
    async def go():  # noqa: ANN202
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://localhost") as http:
            client = anthropic.AsyncAnthropic(
                base_url="http://localhost", api_key="x", http_client=http
            )
            return await scenario(client)

    return run(go())


def test_anthropic_thinking_blocks_whole_and_streamed(app):
    enabled = {"type": "enabled", "budget_tokens": 1024}

    async def scenario(client):  # noqa: ANN001, ANN202
        kwargs = {"model": MODEL, "max_tokens": 16, "messages": SHOWN, "thinking": enabled}
        whole = await client.messages.create(**kwargs, extra_body={"temperature": 0})
        events = []
        async with client.messages.stream(**kwargs, extra_body={"temperature": 0}) as s:
            async for event in s:
                events.append(event)
            streamed = await s.get_final_message()
        off = await client.messages.create(
            model=MODEL,
            max_tokens=16,
            messages=ASK,
            thinking={"type": "disabled"},
            extra_body={"temperature": 0},
        )
        refused = None
        try:
            await client.messages.create(model=MODEL, max_tokens=4, messages=ASK, system="fail")
        except anthropic.BadRequestError as exc:
            refused = exc
        return whole, events, streamed, off, refused

    whole, events, streamed, off, refused = _anthropic(app, scenario)
    for message in (whole, streamed):
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == THOUGHT and message.content[0].signature == ""
        assert message.content[1].text == "Hi!"
    kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events]
    assert ("content_block_delta", "thinking_delta") in kinds
    assert ("content_block_delta", "signature_delta") in kinds
    assert kinds.index(("content_block_delta", "signature_delta")) < kinds.index(
        ("content_block_delta", "text_delta")
    )
    assert [b.type for b in off.content] == ["text"] and off.content[0].text
    # The model's template raised: a 400 in Anthropic's shape.
    assert refused is not None and refused.status_code == 400
    assert refused.body["error"]["type"] == "invalid_request_error"
    assert "no such system prompt" in refused.body["error"]["message"]


def test_responses_reasoning_item_whole_and_streamed(app):
    async def scenario(client, http):  # noqa: ANN001, ANN202
        whole = await client.responses.create(
            model=MODEL, input=SHOWN, max_output_tokens=16, temperature=0, store=False
        )
        events = []
        async for event in await client.responses.create(
            model=MODEL, input=SHOWN, max_output_tokens=16, temperature=0, store=False, stream=True
        ):
            events.append(event)
        # The raw JSON against the SDK's models (it builds its objects unvalidated).
        body = {"model": MODEL, "input": SHOWN, "max_output_tokens": 16, "temperature": 0}
        raw = await http.post("/v1/responses", json=body)
        Response.model_validate(raw.json())
        async with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as sse:
            lines = [line async for line in sse.aiter_lines() if line.startswith("data: ")]
        adapter = TypeAdapter(ResponseStreamEvent)
        for line in lines:
            adapter.validate_python(json.loads(line.removeprefix("data: ")))
        return whole, events

    whole, events = _openai(app, scenario)
    done = next(e for e in events if e.type == "response.completed").response
    for response in (whole, done):
        assert [i.type for i in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == THOUGHT
        assert response.output[0].summary == []
        assert response.output_text == "Hi!"
        reasoning_tokens = response.usage.output_tokens_details.reasoning_tokens
        assert 0 < reasoning_tokens < response.usage.output_tokens  # the answer's are not
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == THOUGHT
    reasoning_done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert reasoning_done.text == THOUGHT and reasoning_done.output_index == 0
    text_added = next(e for e in events if e.type == "response.output_text.delta")
    assert text_added.output_index == 1


def test_a_template_that_raises_is_a_400_in_each_dialect(app):
    async def scenario(client, http):  # noqa: ANN001, ANN202
        failing = [{"role": "system", "content": "fail"}, *ASK]
        chat = await http.post("/v1/chat/completions", json={"messages": failing, **GREEDY})
        native = await http.post(
            "/api/chat", json={"model": MODEL, "messages": failing, "stream": False}
        )
        return chat, native

    chat, native = _openai(app, scenario)
    assert chat.status_code == 400 and "no such system prompt" in chat.json()["error"]["message"]
    # Ollama's shape: {"error": "..."}
    assert native.status_code == 400 and "no such system prompt" in native.json()["error"]


def test_an_assistants_run_keeps_the_thinking_out_of_its_message(app):
    """A run is a chat turn like any other: the thinking is split off the reply, so the
    thread's new message holds the answer alone, streamed or not."""

    async def scenario(client, http):  # noqa: ANN001, ANN202
        assistant = await client.beta.assistants.create(model=MODEL, temperature=0)
        thread = await client.beta.threads.create(messages=SHOWN)
        run = await client.beta.threads.runs.create_and_poll(
            thread_id=thread.id, assistant_id=assistant.id, max_completion_tokens=16
        )
        replies = await client.beta.threads.messages.list(thread.id, limit=1)
        deltas = []
        followed = await client.beta.threads.create(messages=SHOWN)
        async with client.beta.threads.runs.stream(
            thread_id=followed.id, assistant_id=assistant.id, max_completion_tokens=16
        ) as events:
            async for text in events.text_deltas:
                deltas.append(text)
        streamed = await client.beta.threads.messages.list(followed.id, limit=1)
        return run, replies.data[0], "".join(deltas), streamed.data[0]

    run, reply, deltas, streamed = _openai(app, scenario)
    assert run.status == "completed", run.last_error
    assert reply.role == "assistant" and reply.content[0].text.value == "Hi!"
    assert deltas == "Hi!" and streamed.content[0].text.value == "Hi!"
    assert run.usage.completion_tokens > len("Hi!")  # the thinking's tokens count
