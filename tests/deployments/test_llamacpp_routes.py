"""llama.cpp's routes in-process."""

from tests.local_app import http_client, run


def test_llamacpp_slots_cache_save_and_restore(app):
    async def scenario():
        async with http_client(app) as http:
            prompt = "Once upon a time, in a land far away, there lived"
            body = {"prompt": prompt, "n_predict": 4, "id_slot": 0, "temperature": 0}
            first = (await http.post("/completion", json=body)).json()
            longer = prompt + first["content"] + " and"
            again = (await http.post("/completion", json={**body, "prompt": longer})).json()
            slots = (await http.get("/slots")).json()
            saved = (await http.post("/slots/0?action=save", json={"filename": "s0.bin"})).json()
            erased = (await http.post("/slots/0?action=erase")).json()
            restored = (
                await http.post("/slots/0?action=restore", json={"filename": "s0.bin"})
            ).json()
            bad = await http.post("/slots/999?action=erase")
            return first, again, slots, saved, erased, restored, bad

    first, again, slots, saved, erased, restored, bad = run(scenario())
    assert first["tokens_cached"] == 0 and again["tokens_cached"] > 0
    assert {"id", "n_ctx", "is_processing", "state"} <= set(slots[0])
    assert saved["n_saved"] > 0 and saved["n_written"] > 0 and "save_ms" in saved["timings"]
    assert erased["n_erased"] == saved["n_saved"]
    assert restored["n_restored"] == saved["n_saved"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "id_slot"
