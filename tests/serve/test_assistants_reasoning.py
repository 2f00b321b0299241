"""An Assistants run is a chat turn like any other, on the live app too: on a reasoning
template the thinking is split off the reply, so the thread's new message holds the
answer alone (before the chat turn was shared, a run kept the thinking in the message).

Its own app (the default model under a Qwen3-shaped thinking template from a file, see
tests/deployments/test_reasoning_api.py), deleted at the end.
"""

import openai
from ray import serve

from tests.deployments.test_reasoning_api import SHOWN, TEMPLATE, THOUGHT
from tests.serve.live import wait_healthy

MODEL = "smollm2-135m-instruct"
APP, PREFIX = "assistants-reasoning", "/thinking"


def build(state):  # noqa: ANN001, ANN201
    from deployments.builder import build_app
    from deployments.config import AppConfig

    template = state / "thinking.jinja"
    template.write_text(TEMPLATE)
    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "operator": {"enabled": False},
            "database": {"path": str(state / "app.sqlite3")},
            "models": [
                {
                    "name": MODEL,
                    "chat_template": str(template),
                    "num_cpus": 0.5,
                    "engine": {"num_threads": 1, "kv_cache_memory_gib": 0.1},
                }
            ],
        }
    )
    return build_app(config)


def test_a_run_keeps_the_thinking_out_of_its_message(base_url, tmp_path):
    url = f"{base_url}{PREFIX}"
    serve.run(build(tmp_path), name=APP, route_prefix=PREFIX)
    try:
        wait_healthy(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assistant = client.beta.assistants.create(model=MODEL, temperature=0)
        thread = client.beta.threads.create(messages=SHOWN)
        run = client.beta.threads.runs.create_and_poll(
            thread_id=thread.id, assistant_id=assistant.id, max_completion_tokens=16
        )
        reply = client.beta.threads.messages.list(thread.id, limit=1).data[0]
    finally:
        serve.delete(APP)
    assert run.status == "completed", run.last_error
    text = reply.content[0].text.value
    assert reply.role == "assistant" and text == "Hi!"
    assert "<think>" not in text and THOUGHT.strip() not in text
    assert run.usage.completion_tokens > len("Hi!")  # the thinking was written, and counted
