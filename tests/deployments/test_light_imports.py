"""The Ingress, EngineRegistry, Operator and `serve run` driver import no torch, nor does
the Tokenizer of a GGUF model.

Their modules (and every module the driver imports to bind the graph: deployments.builder
reaches the ModelServer, Tokenizer and Embedder deployments) import torch and
transformers only inside the replicas that need them, so those processes never map
libtorch (hundreds of MiB of PSS each). Each check runs in a fresh interpreter: this
test process may have imported torch already.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIGHT = (
    "deployments.http.app",
    "deployments.registry",
    "deployments.operator.operator",
    "deployments.builder",
    "deployments.model_server",
    "deployments.tokenizer",
    "deployments.embeddings",
    "app.engine",
    "app.protocol",
    "app.text.light_tokenizer",
)


def run_clean(code: str, timeout_s: float = 120) -> None:
    """Run `code` in a fresh interpreter at the repo root; it must exit 0."""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("heavy", ["torch", "transformers"])
def test_light_processes_import_no(heavy: str):
    code = (
        f"import {', '.join(LIGHT)}; import sys; "
        "from deployments.builder import graph; graph; "
        f"heavy = sorted(m for m in sys.modules if m == {heavy!r} or m.startswith({heavy!r} + '.')); "
        "assert not heavy, heavy"
    )
    run_clean(code)


def test_the_driver_builds_the_default_graph_without_torch():
    """What `serve run app:graph` does in the driver: resolve the builder, build the app."""
    code = (
        "import sys, app; "
        "from ray.serve._private.api import call_user_app_builder_with_args_if_necessary as b; "
        "b(app.graph, {}); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    run_clean(code)


def test_the_tokenizer_of_a_gguf_model_holds_no_torch():
    """A GGUF's tokenizer is converted once and kept (app.text.light_tokenizer), so the
    Tokenizer deployment of the default model renders and encodes without torch."""
    code = (
        "import sys; from deployments.config import AppConfig; "
        "from deployments.tokenizer import Tokenizer; "
        "config = AppConfig(); name = config.models[0].name; "
        "tokenizer = Tokenizer(config.models); "
        "assert tokenizer.encode(name, 'Hello there'); "
        "assert tokenizer.encode_chat(name, [{'role': 'user', 'content': 'Hi'}]); "
        "assert 'torch' not in sys.modules, 'torch'"
    )
    run_clean(code, timeout_s=300)
