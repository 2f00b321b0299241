import os
import tempfile
from pathlib import Path

import pytest

from tests.helpers import save_tiny_checkpoint

# Apps that name no Assistants database keep theirs in this run's own directory, never in
# the user's home (AppConfig reads this when it is made).
_STATE = Path(tempfile.mkdtemp(prefix="shoal-tests-"))
os.environ.setdefault("SHOAL_ASSISTANTS_DB", str(_STATE / "assistants.sqlite3"))
os.environ.setdefault("SHOAL_MODELS_DIR", str(_STATE / "models"))  # the operator's downloads


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
def smollm2_hf():
    """transformers' own model on the same GGUF weights, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from app.models.source import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from app.models.source import resolve_model
    from app.models.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("default"))
