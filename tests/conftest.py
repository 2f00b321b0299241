import os
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers import save_tiny_checkpoint

# Triton's kernels run on a CPU only in its interpreter, which is chosen when a kernel is
# defined: set before any test imports one (a GPU host runs them compiled).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# What needs CUDA itself is collected only where CUDA is (a skip proves nothing);
# scripts/gpu_check.sh runs it on the GPU host.
collect_ignore = [] if torch.cuda.is_available() else ["engine/test_decode_graphs_cuda.py"]

# Apps that name no Assistants database keep theirs in this run's own directory, never in
# the user's home (AppConfig reads this when it is made).
_STATE = Path(tempfile.mkdtemp(prefix="shoal-tests-"))
os.environ.setdefault("SHOAL_ASSISTANTS_DB", str(_STATE / "assistants.sqlite3"))
os.environ.setdefault("SHOAL_MODELS_DIR", str(_STATE / "models"))  # the operator's downloads
os.environ.setdefault("SHOAL_DATA_DIR", str(_STATE / "files"))  # uploaded files' bytes


# `app:graph` sets Ray's quieter timers in this process's environment for the Ray that
# `serve run` starts after it (deployments/quiet_ray.py); a test that builds the graph
# must not hand them to the Rays later tests start.
_QUIET = ("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS")
_QUIET += ("LOG_NAME_UPDATE_INTERVAL_S",)


@pytest.fixture(autouse=True)
def _no_quiet_ray_left_behind():  # noqa: ANN202
    before = {name: os.environ.get(name) for name in _QUIET}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# Two tiers. `live` marks every test that starts Ray or a server: the live app and Ray
# clusters (tests/serve, tests/cluster), PostgreSQL, the fixture Hub, and the engine in
# processes of its own (an EngineProcess, tensor-parallel shards: marked in their
# modules). `pytest -m "not live"` runs the rest, in-process over the real model: the
# everyday command.
LIVE_FOLDERS = {"serve", "cluster"}
LIVE_FIXTURES = {"serve_app", "base_url", "hub", "postgres_url"}


def pytest_collection_modifyitems(config, items):  # noqa: ANN001, ANN201
    for item in items:
        folder = item.path.relative_to(Path(__file__).parent).parts[0]
        if folder in LIVE_FOLDERS or LIVE_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.live)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (4 query heads, 2 KV heads) as an HF safetensors directory."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_engine():
    """The real default model (SmolLM2-135M-Instruct from its GGUF), dequantized to float32:
    exact against transformers."""
    from app.engine import EngineConfig, LLMEngine

    return LLMEngine(  # on the CPU, as its transformers reference is, also on a GPU host
        EngineConfig(
            device="cpu",
            dtype="float32",
            quantization="none",
            num_threads=2,
            kv_cache_memory_gib=0.5,
        )
    )


@pytest.fixture(scope="session")
def smollm2_quantized():
    """The default GGUF as it is served on a CPU: quantized (int8 activations). Modules
    build their engines over its weights (`LLMEngine(config, loaded=...)`): a load takes
    seconds, an engine over loaded weights none."""
    from app.engine import EngineConfig, LLMEngine

    return LLMEngine(
        EngineConfig(device="cpu", dtype="float32", num_threads=2, kv_cache_memory_gib=0.1)
    )


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own model on the same GGUF weights, float32."""
    import functools
    from unittest import mock

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from app.models.gguf_reader import quick_gguf_reads
    from app.models.source import default_model_path

    quick_gguf_reads()  # the same fields, faster (tests/models/test_gguf_reader.py)
    path = default_model_path()
    # transformers builds gguf's name map afresh for each of the model's 397 modules
    # (3 s); the map of an architecture and layer count is always the same.
    name_map = functools.lru_cache(gguf.get_tensor_name_map)
    with mock.patch.object(gguf, "get_tensor_name_map", name_map):
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from app.models.source import resolve_model
    from app.text.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("default"))
