"""A request's own chat template and template variables (vLLM's `chat_template` and
`chat_template_kwargs`) on /v1/chat/completions and /apply-template, in-process over the
real default model, whose own template knows nothing of thinking (SmolLM2's), on an app
that trusts request templates (`trust_request_chat_template`; off, the default, they
are refused: test_request_template_trust.py)."""

import httpx
import ollama
import openai
import pytest

from app.protocol.messages import MAX_TEMPLATE_CHARS
from deployments.config import AppConfig
from tests.local_app import MODEL, http_client, local_app, run

ASK = [{"role": "user", "content": "What is 2+2?"}]
GREEDY = {"max_tokens": 12, "temperature": 0}
# DeepSeek-R1's way: the generation prompt opens the thinking block.
R1 = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
PERSONA = (
    "<|im_start|>system\nYou are {{ persona }}.<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def app(smollm2_engine, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "assistants": {"database_path": str(state / "assistants.sqlite3")},
            "models": [{"name": MODEL}],
            "trust_request_chat_template": True,
            "template_sandbox": {"timeout_s": 1.0},
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


def test_a_request_template_that_opens_the_thinking_block(app, smollm2_tokenizer):
    """With the parser on auto, the request's own template shows the markers; its prompt
    ends inside the block, so the output is thinking until `</think>`, and with none
    (SmolLM2 never writes it here) all of it is."""

    async def scenario(client, http):  # noqa: ANN001, ANN202
        own = {"chat_template": R1}
        create = client.chat.completions.create
        whole = await create(model=MODEL, messages=ASK, extra_body=own, **GREEDY)
        deltas = []
        stream = await create(model=MODEL, messages=ASK, extra_body=own, stream=True, **GREEDY)
        async for chunk in stream:
            deltas += [c.delta for c in chunk.choices]
        prompt = (await http.post("/apply-template", json={"messages": ASK, **own})).json()
        ids = smollm2_tokenizer(prompt["prompt"], add_special_tokens=False).input_ids
        raw = await http.post("/v1/completions", json={"prompt": ids, **GREEDY})
        plain = await create(model=MODEL, messages=ASK, **GREEDY)
        return whole, deltas, prompt["prompt"], raw.json(), plain

    whole, deltas, prompt, raw, plain = _openai(app, scenario)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    text = raw["choices"][0]["text"]
    assert text and "</think>" not in text
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (text, "")
    thinking = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert thinking == text and not "".join(d.content or "" for d in deltas)
    assert whole.usage.completion_tokens == raw["usage"]["completion_tokens"]
    # The model's own template: no thinking, no reasoning_content.
    assert getattr(plain.choices[0].message, "reasoning_content", None) is None
    assert plain.choices[0].message.content


def test_template_variables_reach_the_template(app):
    async def scenario(client, http):  # noqa: ANN001, ANN202
        async def prompt(persona: str) -> str:
            body = {
                "messages": ASK,
                "chat_template": PERSONA,
                "chat_template_kwargs": {"persona": persona},
            }
            return (await http.post("/apply-template", json=body)).json()["prompt"]

        async def prompt_tokens(persona: str) -> int:
            extra = {"chat_template": PERSONA, "chat_template_kwargs": {"persona": persona}}
            reply = await client.chat.completions.create(
                model=MODEL, messages=ASK, extra_body=extra, max_tokens=1
            )
            return reply.usage.prompt_tokens

        short, long = await prompt("a pirate"), await prompt("a very old and very wise owl")
        return short, long, await prompt_tokens("a pirate"), await prompt_tokens("an owl " * 9)

    short, long, few, many = _openai(app, scenario)
    assert short.startswith("<|im_start|>system\nYou are a pirate.<|im_end|>\n")
    assert "You are a very old and very wise owl." in long
    assert many > few  # the variable is in the prompt the model read


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"chat_template": "{% for %}"}, "chat_template", "TemplateSyntaxError"),
        ({"chat_template": "{{ raise_exception('roles!') }}"}, "chat_template", "roles!"),
        ({"chat_template": "x" * (MAX_TEMPLATE_CHARS + 1)}, "chat_template", "at most"),
        (
            {
                "chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}"
                "{% endfor %}{% endfor %}"
            },
            "chat_template",
            "ran over 1 s",
        ),
        (  # more than the model's context (SmolLM2's 8192 tokens), counted where it renders
            {"chat_template": "{{ 'hello ' * 9000 }}"},
            "chat_template",
            "the model's context holds 8192",
        ),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "tokenize"),
        ({"chat_template_kwargs": {"x": "y" * 70_000}}, "chat_template_kwargs", "at most"),
    ],
)
def test_a_bad_template_is_a_400_on_both_routes(app, extra, param, words):
    async def scenario(client, http):  # noqa: ANN001, ANN202
        body = {"messages": ASK, **extra, **GREEDY}
        chat = await http.post("/v1/chat/completions", json=body)
        applied = await http.post("/apply-template", json=body)
        return chat, applied

    for reply in _openai(app, scenario):
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and words in error["message"]


def test_ollama_think_on_a_model_that_does_not_reason(app):
    async def scenario():  # noqa: ANN202
        client = ollama.AsyncClient(host="http://localhost", transport=httpx.ASGITransport(app=app))
        show = await client.show(MODEL)
        off = await client.chat(MODEL, messages=ASK, think=False, options={"num_predict": 2})
        try:
            await client.chat(MODEL, messages=ASK, think=True)
        except ollama.ResponseError as exc:
            return show, off, exc
        return show, off, None

    show, off, refused = run(scenario())
    assert "thinking" not in show.capabilities
    assert off.message.content and off.message.thinking is None
    assert refused is not None and refused.status_code == 400
    assert "does not support thinking" in refused.error
