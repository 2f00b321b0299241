"""A replica whose engine dies ends its streams cleanly and is replaced by Serve.

Runs after the API tests (file order): it takes the "secured" app's replica down.
"""

import json
import os
import signal
import time

import httpx
from ray import serve

URL = "/secured/v1/chat/completions"
HEADERS = {"Authorization": "Bearer sk-test-1"}
BODY = {
    "model": "secured-model",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 400,
    "ignore_eos": True,
}


def engine_pid() -> int:
    handle = serve.get_deployment_handle("ModelServer:secured-model", app_name="secured")
    return handle.stats.remote().result(timeout_s=30)["engine_pid"]


def test_killed_engine_gives_error_event_and_replica_comes_back(base_url):
    victim = engine_pid()
    events = []
    with httpx.stream(
        "POST", base_url + URL, json={**BODY, "stream": True}, headers=HEADERS, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                os.kill(victim, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] and "engine" in error["message"]
    assert not any(e.startswith('{"error"') for e in events[:-2])

    # The replica leaves at once and Serve starts another. Meanwhile a request waits for it
    # (the secured app's request_timeout_s is 8 s: then a 408) or is refused (503).
    deadline = time.time() + 120
    while time.time() < deadline:
        r = httpx.post(base_url + URL, json={**BODY, "max_tokens": 4}, headers=HEADERS, timeout=60)
        if r.status_code == 200:
            break
        assert r.status_code in (408, 503) and "error" in r.json()  # never a 500 or a hang
        time.sleep(1)
    assert r.status_code == 200, r.text
    assert engine_pid() != victim
