"""What every dialect shares: timing and counting, refusals in each dialect's shape."""

import re

from tests.local_app import MODEL, http_client, run


def _ttft_count(metrics: str) -> float:
    match = re.search(rf'shoal_time_to_first_token_seconds_count{{model="{MODEL}"}} (\S+)', metrics)
    return float(match.group(1)) if match else 0.0


def test_every_dialect_is_timed_and_counted(app):
    """TTFT is recorded for generations started by every dialect, streamed or not."""

    async def scenario():
        async with http_client(app) as http:
            before = _ttft_count((await http.get("/metrics")).text)
            calls = [
                (
                    "/v1/chat/completions",
                    {
                        "model": MODEL,
                        "max_tokens": 3,
                        "stream": True,
                        "messages": [{"role": "user", "content": "Hi"}],
                    },
                ),
                ("/completion", {"prompt": "Hello", "n_predict": 3}),
                ("/completion", {"prompt": "Hello", "n_predict": 3, "stream": True}),
                (
                    "/api/generate",
                    {
                        "model": MODEL,
                        "prompt": "Hi",
                        "stream": False,
                        "options": {"num_predict": 3},
                    },
                ),
                (
                    "/api/chat",
                    {
                        "model": MODEL,
                        "options": {"num_predict": 3},
                        "messages": [{"role": "user", "content": "Hi"}],
                    },
                ),
                ("/fill", {"session_id": 1, "task_id": 1, "context_id": 91, "text": "The sea"}),
                (
                    "/generate",
                    {
                        "session_id": 1,
                        "task_id": 2,
                        "context_id": 91,
                        "sampling_config": {"max_gen_length": 3},
                    },
                ),
            ]
            for path, body in calls:
                r = await http.post(path, json=body)
                assert r.status_code == 200, (path, r.text)
            after = _ttft_count((await http.get("/metrics")).text)
            return after - before, len(calls)

    counted, sent = run(scenario())
    assert counted == sent


def test_refusals_come_back_in_each_dialects_shape(app):
    async def scenario():
        async with http_client(app) as http:
            openai_400 = await http.post(
                "/v1/completions", json={"model": MODEL, "prompt": "x", "seed": -1}
            )
            openai_404 = await http.get("/v1/models/nope")
            ollama_404 = await http.post("/api/chat", json={"model": "nope", "messages": []})
            parrot_404 = await http.post("/free_context", json={"context_id": 12345})
            return openai_400, openai_404, ollama_404, parrot_404

    openai_400, openai_404, ollama_404, parrot_404 = run(scenario())
    assert openai_400.status_code == 400 and openai_400.json()["error"]["param"] == "seed"
    assert openai_404.status_code == 404
    assert openai_404.json()["error"]["code"] == "model_not_found"
    assert ollama_404.status_code == 404 and isinstance(ollama_404.json()["error"], str)
    assert parrot_404.status_code == 404 and "error" in parrot_404.json()
