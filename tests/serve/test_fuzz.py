"""Schemathesis against the live app's own OpenAPI schema: cases no one here wrote, valid
and invalid, for every route. No answer may be a 5xx, and the app must still serve after.

The fuzzed app has a short context (128 tokens) and few sequences, so that any generation
the fuzzer asks for is bounded; everything else is the real app on the real model.
"""

import contextlib
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from ray import serve

from tests.fixture_hub import fixture_hub

FUZZ_MODEL = "fuzz-model"
BUDGET_S = 150.0  # the whole fuzzing pass; operations left when it runs out get fewer cases
EXAMPLES = 12  # per operation and generation mode


@pytest.fixture(scope="module")
def fuzz_url(base_url, tmp_path_factory):
    with fixture_hub() as hub:  # the operator's downloads ask a local hub, never the Hub
        yield from _fuzz_app(base_url, tmp_path_factory, hub.url)


def _fuzz_app(base_url, tmp_path_factory, hub_url):  # noqa: ANN202 (a generator)
    from deployments.builder import build_app
    from deployments.config import AppConfig

    config = AppConfig.model_validate(
        {
            "operator": {
                "hub_endpoint": hub_url,
                "private_hosts": ["127.0.0.1"],
                "models_dir": str(tmp_path_factory.mktemp("fuzz-models")),
            },
            "max_tokens_default": 8,
            "request_timeout_s": 30,
            "models": [
                {
                    "name": FUZZ_MODEL,
                    "num_cpus": 0.5,
                    "engine": {
                        "max_model_len": 128,
                        "max_num_seqs": 16,
                        "kv_cache_memory_gib": 0.25,
                        "num_threads": 1,
                    },
                    "slot_save_path": str(tmp_path_factory.mktemp("fuzz-slots")),
                    "slot_save_quota_bytes": 64 << 20,
                }
            ],
        }
    )
    serve.run(build_app(config), name="fuzz", route_prefix="/fuzz", blocking=False)
    url = f"{base_url}/fuzz"
    deadline = time.time() + 300
    while httpx.get(f"{url}/health", timeout=30).status_code != 200:
        assert time.time() < deadline, "the fuzz app did not start"
        time.sleep(1)
    yield url
    serve.delete("fuzz")


def test_no_route_answers_a_5xx_to_generated_requests(fuzz_url, base_url):
    import schemathesis
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(f"{fuzz_url}/openapi.json")
    # /api/shutdown drains and deletes the app by design (tests/serve/test_operator_live.py
    # tests it): every other route is fuzzed.
    operations = [
        op
        for op in (result.ok() for result in schema.get_all_operations())
        if op.path != "/api/shutdown"
    ]
    assert len(operations) > 20, "the schema should describe every route"
    started = time.monotonic()
    failures: list[str] = []
    calls = {"n": 0}

    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if time.monotonic() - started > BUDGET_S:
                break

            @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def run(case, data) -> None:  # noqa: ANN001
                if time.monotonic() - started > BUDGET_S:
                    return
                calls["n"] += 1
                try:
                    response = case.call(base_url=fuzz_url, timeout=60)
                except Exception as exc:  # a hang or a dropped connection is a failure too
                    failures.append(f"{case.method} {case.formatted_path}: {exc!r}")
                    return
                if response.status_code >= 500:
                    failures.append(
                        f"{case.method} {case.formatted_path} -> {response.status_code}: "
                        f"{response.text[:300]} (body {str(case.body)[:300]})"
                    )

            # Unsatisfiable: nothing to generate in this mode (no parameters to make invalid).
            with contextlib.suppress(Unsatisfiable):
                run()
    print(f"{calls['n']} generated requests over {len(operations)} operations")
    assert not failures, "\n".join(failures[:20])
    # Both apps still answer.
    for url, model in ((fuzz_url, FUZZ_MODEL), (base_url, "smollm2-135m-instruct")):
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": model, "prompt": "Hi", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200, r.text
