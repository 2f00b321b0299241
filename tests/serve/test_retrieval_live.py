"""Files, vector stores, file_search and Conversations on the live app, with the official
(sync) openai SDK, on SQLite and on a PostgreSQL server started here: uploads are
indexed by the ingress's background ingestor through the Embedder deployment; an
Assistants run searches a store and cites it, another stops for a function's output;
an
ingress killed while it indexes a file is replaced and the file is indexed whole,
exactly as a file indexed without a kill; a Responses call searches a store; a
three-turn conversation's third turn computes only its own tokens.

Its own app (float32: greedy output does not depend on how a prompt was split between
cache and compute), deleted at the end."""

import time

import openai
import pytest
import ray
from ray import serve

from tests.deployments.test_vector_stores import DOCS, STATIC
from tests.postgres import postgres_server, unavailable
from tests.retrieval_corpus import documents
from tests.serve.live import wait_healthy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks Assistants so
MODEL = "smollm2-135m-instruct"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
APP, PREFIX = "retrieval-live", "/rlive"
NO_POSTGRES = unavailable()


def build(url: str, data_dir: str):  # noqa: ANN201
    from deployments.builder import build_app
    from deployments.config import AppConfig

    config = AppConfig.model_validate(
        {
            "database": {"url": url},
            "files": {"data_dir": data_dir, "ingest_lease_s": 2.0},
            "models": [
                {
                    "num_cpus": 0.5,
                    "engine": {"dtype": "float32", "num_threads": 1, "kv_cache_memory_gib": 0.25},
                }
            ],
        }
    )
    return build_app(config)


POSTGRES = pytest.param(
    "postgresql", marks=pytest.mark.skipif(NO_POSTGRES is not None, reason=str(NO_POSTGRES))
)


@pytest.fixture(params=["sqlite", POSTGRES])
def database(request, tmp_path):  # noqa: ANN201
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'app.sqlite3'}"
        return
    with postgres_server() as url:
        yield url


def _kill_ingress() -> None:
    """Every replica of this app's ingress, as a crash would end it (Serve starts another)."""
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if name.startswith(f"SERVE_REPLICA::{APP}#Ingress"):
            ray.kill(ray.get_actor(name, namespace=actor["namespace"]), no_restart=True)


def _texts(client: openai.OpenAI, store_id: str, file_id: str) -> list[str]:
    page = client.vector_stores.files.content(file_id, vector_store_id=store_id)
    return [part.text for part in page.data]


def test_retrieval_flows_and_an_ingress_killed_mid_file(base_url, database, tmp_path):
    url = f"{base_url}{PREFIX}"
    serve.run(
        build(database, str(tmp_path / "files")), name=APP, route_prefix=PREFIX, blocking=False
    )
    try:
        wait_healthy(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=3)
        store = client.vector_stores.create(name="notes")
        files = [(name, text.encode()) for name, text in DOCS.items()]
        batch = client.vector_stores.file_batches.upload_and_poll(
            store.id, files=files, chunking_strategy=STATIC, poll_interval_ms=250
        )
        assert batch.status == "completed" and batch.file_counts.completed == 3

        # file_search in a Responses call.
        answer = client.responses.create(
            model=MODEL,
            input="How do bees tell each other where the flowers are?",
            tools=[{"type": "file_search", "vector_store_ids": [store.id]}],
            include=["file_search_call.results"],
            temperature=0,
            max_output_tokens=16,
        )
        assert answer.output[0].type == "file_search_call"
        assert answer.output[0].results[0].filename == "bees.md"

        # A three-turn conversation: the third turn computes only its own tokens.
        conv = client.conversations.create()
        turns = []
        for question in ("I keep bees.", "They make honey.", "What do I keep?"):
            turns.append(
                client.responses.create(
                    model=MODEL,
                    conversation=conv.id,
                    input=question,
                    temperature=0,
                    max_output_tokens=12,
                )
            )
        third = turns[-1].usage
        own = third.input_tokens - third.input_tokens_details.cached_tokens
        assert third.input_tokens_details.cached_tokens >= turns[1].usage.input_tokens
        assert 0 < own < 20, third

        # Assistants: file_search over the store, with citations; a function tool stops
        # the run for its output, which continues it.
        assistants = client.beta.assistants
        searching = assistants.create(
            model=MODEL,
            tools=[{"type": "file_search"}],
            tool_resources={"file_search": {"vector_store_ids": [store.id]}},
            temperature=0,
        )
        thread = client.beta.threads.create(
            messages=[{"role": "user", "content": "How do bees tell where flowers are?"}]
        )
        runs = client.beta.threads.runs
        cited = runs.create_and_poll(
            thread_id=thread.id, assistant_id=searching.id, max_completion_tokens=24
        )
        assert cited.status in ("completed", "incomplete"), cited.last_error
        reply = client.beta.threads.messages.list(thread.id, limit=1).data[0]
        assert reply.content[0].text.annotations[0].type == "file_citation"
        weather = assistants.create(model=MODEL, tools=[WEATHER], temperature=0)
        asked = client.beta.threads.create(
            messages=[{"role": "user", "content": "What is the weather in Paris?"}]
        )
        waiting = runs.create_and_poll(
            thread_id=asked.id,
            assistant_id=weather.id,
            tool_choice=FORCED,
            max_completion_tokens=40,
        )
        assert waiting.status == "requires_action"
        calls = waiting.required_action.submit_tool_outputs.tool_calls
        answered = runs.submit_tool_outputs_and_poll(
            run_id=waiting.id,
            thread_id=asked.id,
            tool_outputs=[{"tool_call_id": c.id, "output": "18 C and sunny"} for c in calls],
        )
        assert answered.status in ("completed", "incomplete"), answered.last_error

        # An ingress killed while it indexes a long file: the file is indexed whole.
        name, text = max(documents().items(), key=lambda d: len(d[1]))  # the longest: ~20 s
        long = client.files.create(file=(name, text.encode()), purpose="assistants")
        cut = client.vector_stores.create(name="cut", file_ids=[long.id])
        assert client.vector_stores.files.retrieve(long.id, vector_store_id=cut.id).status == (
            "in_progress"
        )
        _kill_ingress()
        wait_healthy(url)
        done = client.vector_stores.files.poll(
            long.id, vector_store_id=cut.id, poll_interval_ms=500
        )
        assert done.status == "completed", done.last_error
        clean = client.vector_stores.create(name="clean")
        again = client.vector_stores.files.create_and_poll(
            file_id=long.id, vector_store_id=clean.id, poll_interval_ms=500
        )
        assert again.status == "completed"
        whole = _texts(client, clean.id, long.id)
        assert len(whole) > 3 and _texts(client, cut.id, long.id) == whole
    finally:
        serve.delete(APP)
        time.sleep(1)
