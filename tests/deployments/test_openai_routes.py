"""OpenAI's routes in-process, with the official openai client."""

import asyncio

import openai

from tests.local_app import MODEL, http_client, run


def test_openai_sdk_chat_and_stream(app):
    async def scenario():
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http
            )
            messages = [{"role": "user", "content": "Name a colour."}]
            whole = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0
            )
            pieces = []
            async for chunk in await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
            ):
                pieces += [c.delta.content or "" for c in chunk.choices]
            return whole, "".join(pieces)

    whole, streamed = run(scenario())
    assert whole.choices[0].message.content and whole.usage.completion_tokens <= 8
    assert streamed == whole.choices[0].message.content  # greedy: one text either way


def test_completions_prompt_forms(app):
    """Several prompts run together (in float32, as here, greedy output does not depend on
    the batch; in bfloat16 it may)."""

    async def scenario():
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http
            )
            create = client.completions.create
            one = await create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)
            prompts = ["The sky is", "Water is", "One two three"]
            many = await create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
            alone = [
                await create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts
            ]
            ids = await create(model=MODEL, prompt=[504, 7042, 314], max_tokens=4, temperature=0)
            echo = await create(
                model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, echo=True
            )
            return one, many, alone, ids, echo

    one, many, alone, ids, echo = run(scenario())
    assert one.choices[0].text and one.usage.prompt_tokens > 0
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == one.choices[0].text
    assert [c.text for c in many.choices] == [a.choices[0].text for a in alone]
    assert many.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert ids.usage.prompt_tokens == 3
    assert echo.choices[0].text.startswith("The sky is")


def test_a_refused_prompt_cancels_the_prompts_started_before_it(app, smollm2_engine):
    """The first prompt is generating when the second is refused: the answer is the
    refusal, and nothing is left generating for no one."""

    async def scenario():
        async with http_client(app) as http:
            body = {
                "model": MODEL,
                "prompt": [[504, 7042, 314], [10**9]],  # the second is outside the vocabulary
                "max_tokens": 400,
                "ignore_eos": True,
            }
            refused = await http.post("/v1/completions", json=body)
            for _ in range(100):  # the cancelled request leaves the engine at its next step
                if len(smollm2_engine.requests) == 0:
                    break
                await asyncio.sleep(0.05)
        return refused, len(smollm2_engine.requests)

    refused, left = run(scenario())
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    assert left == 0
