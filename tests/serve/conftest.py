"""A local Ray instance and the real app on the real default model, once per session."""

import socket
import time
from pathlib import Path

import httpx
import pytest

MODEL = "smollm2-135m-instruct"
APP_PORT = 8000


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="session")
def slot_dir(tmp_path_factory) -> Path:
    """The secured app's slot directory (the default app has none: its slot saves are 501)."""
    return tmp_path_factory.getbasetemp() / "slots" / "secured"


@pytest.fixture(scope="session")
def serve_app(slot_dir):
    import ray
    from ray import serve

    from deployments.builder import build_app
    from deployments.config import AppConfig

    assert _free(APP_PORT), f"port {APP_PORT} is busy"
    slot_root = slot_dir
    # More logical CPUs than cores: replicas declare fractions, the engine sets its own threads.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": APP_PORT})
        serve.run(build_app(AppConfig()), name="default", route_prefix="/", blocking=False)
        secured = AppConfig.model_validate(
            {
                "api_keys": ["sk-test-1", "sk-test-2"],
                "cors_origins": ["https://app.example"],
                "embeddings": {"enabled": False},
                "max_request_bytes": 4096,
                "request_timeout_s": 8,
                "request_body_timeout_s": 2,
                # Tight limits so that the overload test can fill them.
                "models": [
                    {
                        "name": "secured-model",
                        "num_cpus": 0.5,
                        "max_ongoing_requests": 2,
                        "max_queued_requests": 1,
                        "slot_save_path": str(slot_root),
                        # served with speculative decoding (test_openai_api.py)
                        "engine": {"speculative": {"method": "ngram"}},
                    }
                ],
            }
        )
        serve.run(build_app(secured), name="secured", route_prefix="/secured", blocking=False)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if (
                    httpx.get(f"http://127.0.0.1:{APP_PORT}/health", timeout=2).status_code == 200
                    and httpx.get(
                        f"http://127.0.0.1:{APP_PORT}/secured/health", timeout=2
                    ).status_code
                    == 200
                ):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield f"http://127.0.0.1:{APP_PORT}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def base_url(serve_app) -> str:
    return serve_app


@pytest.fixture(scope="session")
def client(base_url):
    from openai import OpenAI

    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def model_stats():
    from ray import serve

    handle = serve.get_deployment_handle(f"ModelServer:{MODEL}", app_name="default")
    return lambda: handle.stats.remote().result()
