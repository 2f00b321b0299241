"""What several live-app tests share (not a test module)."""

import time

import httpx


def wait_healthy(url: str, timeout_s: float = 300) -> None:
    """Until the app at `url` answers /health with 200 (it is starting or restarting)."""
    deadline = time.time() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "the app did not become healthy"
        time.sleep(0.5)
