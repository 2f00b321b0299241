"""Ollama's routes in-process."""

from tests.local_app import MODEL, http_client, run


def test_ollama_generate_reports_its_prompt_and_figures(app, smollm2_tokenizer):
    async def scenario():
        async with http_client(app) as http:
            body = {"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 4}}
            plain = (await http.post("/api/generate", json=body)).json()
            system = "You answer like a pirate."
            with_system = (await http.post("/api/generate", json={**body, "system": system})).json()
            return plain, with_system, system

    plain, with_system, system = run(scenario())
    assert (
        plain["done"] and plain["eval_count"] == len(plain["context"]) - plain["prompt_eval_count"]
    )
    assert plain["total_duration"] >= plain["prompt_eval_duration"] > 0
    assert plain["load_duration"] == 0  # the model is always loaded
    # The system prompt is in the prompt the model read, not just somewhere nearby.
    prompt = with_system["context"][: with_system["prompt_eval_count"]]
    assert system in smollm2_tokenizer.decode(prompt)
    assert system not in smollm2_tokenizer.decode(plain["context"])
