"""Stored Responses are the app's, not an ingress replica's: with two ingress replicas,
Serve's proxy sends each turn to either, and every chain continues wherever its next
turn lands (with the store in each replica's memory, about half of them got a 404).

Its own app (two ingress replicas sharing one SQLite file: one node here), deleted at
the end.
"""

import openai
from ray import serve

from tests.serve.live import wait_healthy

MODEL = "smollm2-135m-instruct"
APP, PREFIX = "responses-replicas", "/two"
CHAINS = 10


def build(db_url: str):  # noqa: ANN201
    from deployments.builder import build_app
    from deployments.config import AppConfig

    config = AppConfig.model_validate(
        {
            "ingress_replicas": 2,
            "embeddings": {"enabled": False},
            "operator": {"enabled": False},
            "assistants": {"enabled": False},
            "database": {"url": db_url},
            "models": [{"num_cpus": 0.5, "engine": {"num_threads": 1, "kv_cache_memory_gib": 0.1}}],
        }
    )
    return build_app(config)


def test_every_chain_continues_through_either_ingress_replica(base_url, tmp_path):
    url = f"{base_url}{PREFIX}"
    serve.run(build(f"sqlite:///{tmp_path / 'app.sqlite3'}"), name=APP, route_prefix=PREFIX)
    try:
        wait_healthy(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        greedy = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
        firsts = [client.responses.create(input=f"Count to {i}.", **greedy) for i in range(CHAINS)]
        seconds = [
            client.responses.create(input="And back.", previous_response_id=first.id, **greedy)
            for first in firsts
        ]
        fetched = [client.responses.retrieve(second.id) for second in seconds]
    finally:
        serve.delete(APP)
    for first, second, again in zip(firsts, seconds, fetched, strict=True):
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens > first.usage.input_tokens  # the history came along
        assert again.id == second.id and again.output_text == second.output_text
