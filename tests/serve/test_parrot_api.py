"""Parrot's primitives through the live app: Fill, Generate, forks, free, errors."""

import json

import httpx
import pytest

from tests.serve.conftest import MODEL


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=120)


def ids(session: int, task: int, context: int, parent: int | None = None) -> dict:
    body = {"session_id": session, "task_id": task, "context_id": context}
    if parent is not None:
        body["parent_context_id"] = parent
    return body


GREEDY = {"temperature": 0, "max_gen_length": 12, "ignore_tokenizer_eos": True}


def test_fill_generate_fill_generate_matches_one_completion(base_url):
    text_a = "The capital of France is Paris. The capital of Italy is"
    r = post(base_url, "/fill", {**ids(1, 1, 101), "text": text_a})
    assert r.status_code == 200 and r.json()["filled_len"] > 5
    g1 = post(base_url, "/generate", {**ids(1, 2, 101), "sampling_config": GREEDY}).json()
    assert len(g1["generated_ids"]) == 12 and g1["generated_text"]
    tail = [28, 198, 504]  # a few token ids
    assert post(base_url, "/fill", {**ids(1, 3, 101), "token_ids": tail}).status_code == 200
    g2 = post(base_url, "/generate", {**ids(1, 4, 101), "sampling_config": GREEDY}).json()

    # One request over the concatenated tokens continues the same way (greedy).
    whole = _tokenize(base_url, text_a) + g1["generated_ids"] + tail
    one = httpx.post(
        f"{base_url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": whole,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    ).json()
    assert one["choices"][0]["text"] == g2["generated_text"]
    freed = post(base_url, "/free_context", {"context_id": 101}).json()
    assert freed["context_len"] == len(whole) + 12


def _tokenize(base_url: str, text: str) -> list[int]:
    r = httpx.post(f"{base_url}/tokenize", json={"content": text, "add_special": False}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_fork_generates_from_the_parent_and_streams(base_url):
    post(base_url, "/fill", {**ids(2, 1, 201), "text": "Once upon a time, in a small village,"})
    body = {**ids(2, 2, 202, parent=201), "sampling_config": GREEDY}
    streamed_ids, text = [], ""
    with httpx.stream("POST", f"{base_url}/generate_stream", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                streamed_ids += event["token_ids"]
                text += event["text"]
    assert len(streamed_ids) == 12
    # The parent is untouched: generating on it gives the same continuation.
    again = post(base_url, "/generate", {**ids(2, 3, 201), "sampling_config": GREEDY}).json()
    assert again["generated_ids"] == streamed_ids and again["generated_text"] == text
    for cid in (201, 202):
        assert post(base_url, "/free_context", {"context_id": cid}).status_code == 200


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/generate", {**ids(3, 1, 999), "sampling_config": GREEDY}, 404),
        ("/fill", {**ids(3, 1, 301, parent=998), "text": "x"}, 404),
        ("/free_context", {"context_id": 997}, 404),
        ("/fill", {**ids(3, 1, 302), "text": "x", "token_ids": [1]}, 400),
        ("/fill", {**ids(3, 1, 303)}, 400),
        ("/fill", {**ids(3, 1, 304), "token_ids": []}, 400),
        ("/fill", {**ids(3, 1, 305), "text": ""}, 400),
        ("/fill", {**ids(3, 1, -5), "text": "x"}, 400),
        ("/fill", {**ids(3, 1, 306), "token_ids": [10**9]}, 400),
        ("/fill", {**ids(3, 1, 307, parent=307), "text": "x"}, 400),
        ("/generate", {**ids(3, 1, 308), "sampling_config": {"temperature": -1}}, 400),
        ("/fill", {"context_id": 309, "text": "x"}, 400),
    ],
)
def test_bad_primitives_get_clear_errors(base_url, path, body, status):
    r = post(base_url, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


def test_ping_engine(base_url):
    r = httpx.get(f"{base_url}/ping_engine", timeout=60)
    assert r.status_code == 200 and r.json()["pong"] is True


def test_llamacpp_health_slots_props_tokenize(base_url):
    plain = httpx.get(f"{base_url}/health", timeout=30).json()
    assert plain["status"] == "ok" and plain["slots_idle"] > 0 and "slots" not in plain
    h = httpx.get(f"{base_url}/health", params={"include_slots": "true"}, timeout=30).json()
    assert h["status"] == "ok" and h["slots_idle"] > 0 and h["slots_processing"] >= 0
    assert len(h["slots"]) == h["slots_idle"] + h["slots_processing"]
    slots = httpx.get(f"{base_url}/slots", timeout=30).json()
    assert {"id", "state", "n_ctx", "is_processing"} <= set(slots[0])
    props = httpx.get(f"{base_url}/props", timeout=30).json()
    assert props["total_slots"] == len(slots) and "{%" in props["chat_template"]
    assert props["default_generation_settings"]["params"]["max_tokens"] > 0
    assert props["default_generation_settings"]["n_ctx"] == slots[0]["n_ctx"] == 8192
    toks = httpx.post(
        f"{base_url}/tokenize", json={"content": "Hello world", "with_pieces": True}, timeout=30
    ).json()["tokens"]
    assert "".join(t["piece"] for t in toks) == "Hello world"
    text = httpx.post(
        f"{base_url}/detokenize", json={"tokens": [t["id"] for t in toks]}, timeout=30
    ).json()
    assert text["content"] == "Hello world"
    bad = httpx.post(f"{base_url}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400


def test_llamacpp_completion_with_a_slot_reuses_its_prompt(base_url):
    prompt = "Here is a list of fruits: apple, banana, cherry,"
    body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "id_slot": 3}
    first = httpx.post(f"{base_url}/completion", json=body, timeout=120).json()
    assert first["tokens_predicted"] == 8 or first["stop_type"] == "eos"
    assert first["tokens_cached"] == 0 and first["content"]
    longer = {**body, "prompt": prompt + first["content"] + " and"}
    second = httpx.post(f"{base_url}/completion", json=longer, timeout=120).json()
    assert second["tokens_cached"] > 0  # the slot kept the first prompt and its reply
    plain = httpx.post(f"{base_url}/completion", json={**longer, "id_slot": -1}, timeout=120).json()
    assert plain["content"] == second["content"]
    stopped = httpx.post(
        f"{base_url}/completion", json={**body, "id_slot": -1, "stop": [","]}, timeout=120
    ).json()
    assert stopped["stop_type"] == "word" and "," not in stopped["content"]
    pieces = []
    with httpx.stream("POST", f"{base_url}/completion", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                pieces.append(json.loads(line[6:]))
    assert pieces[-1]["stop"] is True
    assert "".join(p["content"] for p in pieces) == first["content"]
    assert httpx.post(f"{base_url}/slots/3?action=erase", timeout=60).json()["n_erased"] > 0


def test_infill_without_fim_tokens_says_so(base_url):
    r = httpx.post(
        f"{base_url}/infill", json={"input_prefix": "def f(", "input_suffix": "):"}, timeout=60
    )
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]


def test_slot_save_restore_need_a_directory(base_url):
    r = httpx.post(f"{base_url}/slots/0?action=save", json={"filename": "a.bin"}, timeout=60)
    assert r.status_code == 501
    bad = httpx.post(f"{base_url}/slots/0?action=fly", json={"filename": "a"}, timeout=60)
    assert bad.status_code == 400


def test_slot_save_erase_restore_through_the_api(base_url, slot_dir):
    url, auth = f"{base_url}/secured", {"Authorization": "Bearer sk-test-1"}

    def call(path: str, **kw) -> httpx.Response:
        return httpx.post(f"{url}{path}", headers=auth, timeout=120, **kw)

    body = {"prompt": "The three primary colors are", "n_predict": 6, "temperature": 0}
    first = call("/completion", json={**body, "id_slot": 2}).json()
    saved = call("/slots/2?action=save", json={"filename": "colors.slot"}).json()
    assert saved["n_saved"] > 0 and (slot_dir / "colors.slot").is_file()
    assert call("/slots/2?action=erase").json()["n_erased"] == saved["n_saved"]
    restored = call("/slots/2?action=restore", json={"filename": "colors.slot"}).json()
    assert restored["n_restored"] == saved["n_saved"]
    follow = {**body, "prompt": body["prompt"] + first["content"] + " and", "id_slot": 2}
    again = call("/completion", json=follow).json()
    assert again["tokens_cached"] > 0  # served from the restored KV
    fresh = call("/completion", json={**follow, "id_slot": -1}).json()
    assert again["content"] == fresh["content"]

    (slot_dir / "junk.slot").write_bytes(b"not a slot file")
    for name in ("../outside", "a/b", "..", ".hidden", "x" * 256, "a\u2215b", "nul\x00"):
        r = call("/slots/2?action=save", json={"filename": name})
        assert r.status_code == 400, (name, r.text)
    assert not (slot_dir.parent / "outside").exists()
    for name in ("junk.slot", "missing.slot"):
        r = call("/slots/2?action=restore", json={"filename": name})
        assert r.status_code == 400 and r.json()["error"]["message"]
    assert call("/completion", json=body).status_code == 200  # the replica is fine


def test_engines_lists_live_replicas_with_runtime_info(base_url):
    import time

    deadline = time.time() + 30
    while True:
        engines = httpx.get(f"{base_url}/engines", timeout=30).json()["engines"]
        if engines and engines[0]["runtime_info"]:
            break
        assert time.time() < deadline, engines
        time.sleep(1)
    engine = engines[0]
    assert engine["engine_name"] == MODEL and engine["seconds_since_heartbeat"] < 10
    assert {
        "num_running",
        "num_waiting",
        "kv_blocks_used",
        "kv_blocks_free",
        "num_contexts",
        "tokens_per_s",
    } <= set(engine["runtime_info"])
