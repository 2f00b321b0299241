"""llama.cpp's /completion and /apply-template in-process, with what llama.cpp's own
clients read: prompt forms, logit_bias in both forms, n_probs, response_fields, tokens
and timings."""

import json

import openai

from tests.local_app import MODEL, http_client, run

PROMPT = "The capital of France is"


async def _events(http, body: dict) -> list[dict]:  # noqa: ANN001
    async with http.stream("POST", "/completion", json=body) as response:
        assert response.status_code == 200
        text = "".join([chunk async for chunk in response.aiter_text()])
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_completion_reports_tokens_timings_and_settings(app):
    async def scenario():
        async with http_client(app) as http:
            body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0}
            plain = (await http.post("/completion", json=body)).json()
            ids = (await http.post("/completion", json={**body, "return_tokens": True})).json()
            events = await _events(
                http, {**body, "stream": True, "return_progress": True, "timings_per_token": True}
            )
            return plain, ids, events

    plain, ids, events = run(scenario())
    assert plain["tokens"] == [] and len(ids["tokens"]) == ids["tokens_predicted"] == 6
    assert plain["stop_type"] == "limit" and isinstance(plain["has_new_line"], bool)
    assert plain["generation_settings"]["n_predict"] == 6
    assert plain["prompt"].endswith(PROMPT)
    timings = plain["timings"]
    assert timings["predicted_n"] == 6 and timings["prompt_ms"] > 0
    assert timings["prompt_n"] + timings["cache_n"] == plain["tokens_evaluated"]
    progress, *tokens, last = events
    assert progress["prompt_progress"]["total"] == plain["tokens_evaluated"]
    assert all(e["tokens"] and "timings" in e and e["stop"] is False for e in tokens)
    assert [t for e in tokens for t in e["tokens"]] == ids["tokens"]
    assert "".join(e["content"] for e in tokens) == plain["content"]
    assert last["stop"] is True and last["timings"]["predicted_n"] == 6


def test_completion_prompt_forms(app):
    """A list of prompts answers a list; ids, texts and ids mixed with texts are one
    prompt each, the first text with the BOS a text prompt starts with."""

    async def scenario():
        async with http_client(app) as http:
            base = {"n_predict": 4, "temperature": 0}
            tokens = (await http.post("/tokenize", json={"content": PROMPT})).json()["tokens"]
            text = (await http.post("/completion", json={**base, "prompt": PROMPT})).json()
            by_ids = (await http.post("/completion", json={**base, "prompt": tokens})).json()
            many = await http.post("/completion", json={**base, "prompt": [tokens, PROMPT]})
            split = PROMPT.split(" France ")
            mixed = (
                await http.post(
                    "/completion",
                    json={
                        **base,
                        "prompt": [split[0], *await _ids(http, " France"), " " + split[1]],
                    },
                )
            ).json()
            streamed_many = await http.post(
                "/completion", json={**base, "prompt": [PROMPT, PROMPT], "stream": True}
            )
            as_object = await http.post(
                "/completion", json={**base, "prompt": {"prompt_string": PROMPT}}
            )
            with_media = await http.post(
                "/completion",
                json={**base, "prompt": {"prompt_string": PROMPT, "multimodal_data": ["iVBO"]}},
            )
            return text, by_ids, many, mixed, streamed_many, as_object, with_media

    text, by_ids, many, mixed, streamed_many, as_object, with_media = run(scenario())
    assert as_object.json()["content"] == text["content"]  # llama.cpp's JSON prompt object
    assert (
        with_media.status_code == 400
        and "image input is not supported" in with_media.json()["error"]["message"]
    )
    assert by_ids["content"] == text["content"]
    assert many.status_code == 200 and [r["content"] for r in many.json()] == [text["content"]] * 2
    assert mixed["tokens_evaluated"] == text["tokens_evaluated"]
    assert streamed_many.status_code == 400


async def _ids(http, text: str) -> list[int]:  # noqa: ANN001
    return (await http.post("/tokenize", json={"content": text})).json()["tokens"]


def test_logit_bias_bans_words_in_both_forms(app):
    """A text's bias reaches every token of its encoding; `false` bans; the map form
    takes ids and texts as keys."""

    async def scenario():
        async with http_client(app) as http:
            base = {"prompt": PROMPT, "n_predict": 6, "temperature": 0}
            free = (await http.post("/completion", json=base)).json()["content"]
            word = free.split()[0]
            ids = await _ids(http, " " + word)
            answers = []
            for bias in (
                [[" " + word, False]],
                {" " + word: -100},
                [[i, -100] for i in ids],
                {str(i): False for i in ids},
            ):
                reply = await http.post("/completion", json={**base, "logit_bias": bias})
                answers.append(reply.json()["content"])

            settings = await http.post(
                "/completion", json={**base, "ignore_eos": True, "logit_bias": [[ids[0], -2]]}
            )
            return free, word, answers, ids, settings.json()["generation_settings"]

    free, word, answers, ids, settings = run(scenario())
    # llama.cpp's shape: {bias, token}; the end-of-generation token banned by ignore_eos
    # shows as a null (-inf) bias
    assert {"bias": -2.0, "token": ids[0]} in settings["logit_bias"]
    assert any(e["bias"] is None for e in settings["logit_bias"])
    assert free.split()[0] == word
    for answer in answers:
        assert not answer.split() or answer.split()[0] != word


def test_n_probs_and_response_fields(app):
    async def scenario():
        async with http_client(app) as http:
            base = {"prompt": PROMPT, "n_predict": 3, "temperature": 0, "n_probs": 4}
            lp = (await http.post("/completion", json=base)).json()
            probs = await http.post("/completion", json={**base, "post_sampling_probs": True})
            events = await _events(http, {**base, "stream": True})
            fields = ["content", "generation_settings/n_predict", "timings/predicted_n", "nope"]
            cut = (await http.post("/completion", json={**base, "response_fields": fields})).json()
            return lp, probs.json(), events, cut

    lp, probs, events, cut = run(scenario())
    assert len(lp["completion_probabilities"]) == 3
    for tok in lp["completion_probabilities"]:
        assert tok["logprob"] <= 0 and len(tok["top_logprobs"]) == 4
        assert tok["id"] == tok["top_logprobs"][0]["id"]  # greedy: the most likely
        assert bytes(tok["bytes"]).decode() == tok["token"]
    assert all(
        0 < t["prob"] <= 1 and len(t["top_probs"]) == 4 for t in probs["completion_probabilities"]
    )
    streamed = [t for e in events if not e["stop"] for t in e["completion_probabilities"]]
    assert [t["id"] for t in streamed] == [t["id"] for t in lp["completion_probabilities"]]
    assert cut == {
        "content": lp["content"],
        "generation_settings/n_predict": 3,
        "timings/predicted_n": 3,
    }


def test_apply_template_is_what_chat_feeds_the_model(app):
    async def scenario():
        async with http_client(app) as http:
            messages = [
                {"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What colour is the sky?"},
            ]
            prompt = (await http.post("/apply-template", json={"messages": messages})).json()
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http
            )
            chat = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, temperature=0
            )
            body = {"prompt": prompt["prompt"], "n_predict": 6, "temperature": 0}
            tokens = await http.post("/tokenize", json={"content": prompt["prompt"]})
            raw = await http.post("/completion", json={**body, "prompt": tokens.json()["tokens"]})
            return prompt["prompt"], chat, tokens.json()["tokens"], raw.json()

    prompt, chat, tokens, raw = run(scenario())
    assert prompt.startswith("<|im_start|>system\nAnswer in one word.")
    assert prompt.endswith("<|im_start|>assistant\n")
    assert len(tokens) == chat.usage.prompt_tokens
    assert raw["content"] == chat.choices[0].message.content
