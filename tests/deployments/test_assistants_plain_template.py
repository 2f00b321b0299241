"""An assistant with functions on a model whose chat template cannot show tools: a run
that may not call them (tool_choice "none") is rendered without them and answers, as it
did when "none" hid the functions; one that may call them is a 400 that says why."""

import openai
import pytest

from deployments.config import AppConfig
from tests.local_app import MODEL, http_client, local_app, run

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PLAIN = (  # not ChatML either (which gets Shoal's ChatML tools template)
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def served(smollm2_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("plain-template")
    config = AppConfig.model_validate(
        {
            "database": {"url": f"sqlite:///{root / 'app.sqlite3'}"},
            "models": [{"name": MODEL, "chat_template": PLAIN}],
        }
    )
    with local_app(config, smollm2_engine) as (app, _):
        yield app


def test_a_run_that_may_not_call_is_shown_no_functions(served):
    async def go():  # noqa: ANN202
        async with http_client(served) as http:
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http
            )
            a = await client.beta.assistants.create(model=MODEL, tools=[WEATHER], temperature=0)
            thread = await client.beta.threads.create(
                messages=[{"role": "user", "content": "Say hello."}]
            )
            runs = client.beta.threads.runs
            quiet = await runs.create_and_poll(
                thread_id=thread.id, assistant_id=a.id, tool_choice="none", max_completion_tokens=8
            )
            failed = await runs.create_and_poll(
                thread_id=thread.id, assistant_id=a.id, max_completion_tokens=8
            )
            return quiet, failed

    quiet, failed = run(go())
    assert quiet.status in ("completed", "incomplete"), quiet.last_error
    assert failed.status == "failed" and "does not render tools" in failed.last_error.message
