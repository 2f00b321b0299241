"""In-process apps: the real routes, Ingress, Tokenizer and ModelServer over the real
default model's engine, without Ray (see tests/local_app.py). One per test module: the
engine is stepped by the app's thread while it lives."""

import pytest

from deployments.config import AppConfig
from tests.local_app import MODEL, local_app


@pytest.fixture(scope="module")
def app(smollm2_engine, tmp_path_factory):
    slots = tmp_path_factory.mktemp("slots")
    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "assistants": {"database_path": str(slots / "assistants.sqlite3")},
            "models": [{"name": MODEL, "slot_save_path": str(slots)}],
        }
    )
    with local_app(config, smollm2_engine) as (app, _):
        yield app
