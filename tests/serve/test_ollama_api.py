"""Ollama's API through the live app, with the official ollama client."""

import httpx
import ollama
import pytest

from tests.serve.conftest import MODEL

GREEDY = {"temperature": 0, "num_predict": 12, "seed": 1}


@pytest.fixture(scope="module")
def client(base_url):
    return ollama.Client(host=base_url, timeout=120)


def test_generate_streamed_equals_not_streamed(client):
    whole = client.generate(model=MODEL, prompt="Name a fruit.", options=GREEDY)
    pieces = list(client.generate(model=MODEL, prompt="Name a fruit.", options=GREEDY, stream=True))
    assert "".join(p.response for p in pieces) == whole.response and whole.response
    last = pieces[-1]
    assert last.done and last.done_reason in ("stop", "length")
    for r in (whole, last):
        assert r.eval_count == 12 or r.done_reason == "stop"
        assert 0 < r.prompt_eval_count < 100
        assert r.total_duration >= r.eval_duration > 0 and r.prompt_eval_duration > 0
        # Prompt eval lasts until the first token, eval after it: together the whole time.
        assert r.prompt_eval_duration + r.eval_duration <= r.total_duration
        assert r.load_duration == 0  # the model is always loaded: nothing to load


def test_generate_context_continues_the_conversation(client):
    first = client.generate(model=MODEL, prompt="My name is Ada.", options=GREEDY)
    assert first.context and len(first.context) > first.prompt_eval_count
    second = client.generate(
        model=MODEL, prompt="What is my name?", context=first.context, options=GREEDY
    )
    assert second.prompt_eval_count > len(first.context)


def test_generate_system_raw_and_template(client, base_url):
    system = "Answer in French."
    sys_out = client.generate(model=MODEL, prompt="Hi", system=system, options=GREEDY)
    plain = client.generate(model=MODEL, prompt="Hi", options=GREEDY)
    raw = client.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True, options=GREEDY)
    templ = client.generate(
        model=MODEL, prompt="1, 2, 3, 4,", template="{{ .Prompt }}", options=GREEDY
    )
    assert sys_out.response and raw.response == templ.response

    def prompt_text(r) -> str:  # noqa: ANN001 (what the model read: the context's prompt part)
        tokens = r.context[: r.prompt_eval_count]
        return httpx.post(f"{base_url}/detokenize", json={"tokens": tokens}, timeout=30).json()[
            "content"
        ]

    assert system in prompt_text(sys_out) and system not in prompt_text(plain)
    assert raw.prompt_eval_count == templ.prompt_eval_count  # the same text, unwrapped


def test_chat_streamed_equals_not_streamed(client):
    messages = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Say hello."},
    ]
    whole = client.chat(model=MODEL, messages=messages, options=GREEDY)
    pieces = list(client.chat(model=MODEL, messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in pieces) == whole.message.content
    assert whole.message.role == "assistant" and whole.done and whole.eval_count > 0


def test_embed_tags_show_ps_version(client, base_url):
    e = client.embed(model="all-MiniLM-L6-v2", input=["one", "two"])
    assert len(e.embeddings) == 2 and len(e.embeddings[0]) == 384
    legacy = client.embeddings(model="all-MiniLM-L6-v2", prompt="one")
    assert len(legacy.embedding) == 384
    names = [m.model for m in client.list().models]
    assert f"{MODEL}:latest" in names
    shown = client.show(MODEL)
    assert shown.template and "num_ctx" in shown.parameters
    running = [m.model for m in client.ps().models]  # tags also lists what is on disk
    assert f"{MODEL}:latest" in running and set(running) <= set(names)
    assert httpx.get(f"{base_url}/api/version", timeout=30).json()["version"]
    assert httpx.get(f"{base_url}/", timeout=30).text == "Ollama is running"
    assert httpx.head(f"{base_url}/", timeout=30).status_code == 200


@pytest.mark.parametrize(
    "call, status",
    [
        (lambda c: c.generate(model="no-such-model", prompt="x"), 404),
        (lambda c: c.chat(model="no-such-model", messages=[{"role": "user", "content": "x"}]), 404),
        (lambda c: c.generate(model=MODEL, prompt="x", options={"num_ctx": 10**7}), 400),
        (lambda c: c.generate(model=MODEL, prompt="x", options={"temperature": -3}), 400),
        (lambda c: c.generate(model=MODEL, prompt="x", format={"type": "nonsense"}), 400),
        (lambda c: c.embed(model="no-such-model", input="x"), 404),
    ],
)
def test_errors_in_ollama_shape(client, base_url, call, status):
    with pytest.raises(ollama.ResponseError) as info:
        call(client)
    assert info.value.status_code == status and info.value.error
    # The raw body is Ollama's {"error": "..."}, and the server answers the next request.
    r = httpx.post(f"{base_url}/api/generate", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and set(r.json()) == {"error"}
    assert client.generate(model=MODEL, prompt="Hi", options={"num_predict": 2}).done
