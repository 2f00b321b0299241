"""Loading checkpoints: our model's logits against transformers', and clear errors."""

import json
from pathlib import Path

import pytest
import torch

from app.models.attention_backends import select_backend
from app.models.families import read_arch_config
from app.models.loader import load_model
from app.models.source import ModelSource, resolve_model
from app.protocol import ModelLoadError, SamplingParams
from tests.helpers import cpu_engine, save_tiny_checkpoint, tiny_engine

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama": dict(architecture="llama"),
    "llama3-rope": dict(architecture="llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "llama-tied-sharded": dict(
        architecture="llama", tie_word_embeddings=True, max_shard_size="60KB"
    ),
    "qwen2-bias": dict(architecture="qwen2"),
    "mistral": dict(architecture="mistral", sliding_window=None),
}


def hf_logits(directory: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case: str, tmp_path: Path):
    settings = dict(CASES[case])
    directory = save_tiny_checkpoint(tmp_path, **settings)
    if "max_shard_size" in settings:
        assert (directory / "model.safetensors.index.json").is_file()
    ids = [3, 17, 99, 4, 250, 8, 8, 61, 12, 140] * 7  # 70 tokens: past the llama3 original length
    engine = tiny_engine(directory)
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    ours = out[0].outputs[0].logprobs[0]
    ref = torch.log_softmax(hf_logits(directory, ids), dim=-1)
    assert ours.token_id == int(ref.argmax())
    for token_id, logprob in ours.top:
        assert abs(logprob - float(ref[token_id])) < 1e-4


def test_architecture_details_are_read(tmp_path: Path):
    qwen = read_arch_config(_hf_config(save_tiny_checkpoint(tmp_path / "q", "qwen2")), "q")
    assert qwen.qkv_bias and qwen.architecture == "Qwen2ForCausalLM"
    llama = read_arch_config(
        _hf_config(save_tiny_checkpoint(tmp_path / "l", rope_scaling=LLAMA3_ROPE)), "l"
    )
    assert llama.rope_scaling["rope_type"] == "llama3" and not llama.qkv_bias
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (4, 2, 16)


def test_default_model_is_smollm2():
    source = resolve_model("default")
    assert source.is_gguf and source.gguf_file.endswith(".gguf")
    arch = read_arch_config(_hf_config_of(source), source.name)
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (30, 576, 9, 3)
    assert arch.vocab_size == 49152 and arch.tie_word_embeddings


def test_unknown_architecture_is_named(tmp_path: Path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="(?i)unsupported architecture.*gpt2") as err:
        tiny_engine(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_missing_files_are_named(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(tmp_path / "nowhere.gguf"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(tmp_path / "absent-dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    directory = save_tiny_checkpoint(tmp_path / "sharded", max_shard_size="60KB")
    shard = sorted(directory.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"missing weight files: {shard.name}"):
        tiny_engine(directory)


def test_missing_tensors_are_reported(tmp_path: Path):
    from safetensors.torch import load_file, save_file

    directory = save_tiny_checkpoint(tmp_path)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing.*layers.1.mlp.down_proj"):
        tiny_engine(directory)


def test_corrupt_safetensors(tmp_path: Path):
    directory = save_tiny_checkpoint(tmp_path)
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="corrupt weights in model.safetensors"):
        tiny_engine(directory)


def test_wrong_shapes_are_reported(tmp_path: Path):
    directory = save_tiny_checkpoint(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] = 96
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="mlp.*shape"):
        tiny_engine(directory)


def test_corrupt_gguf(tmp_path: Path):
    from app.models.source import default_model_path

    good = default_model_path().read_bytes()
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(good[: len(good) // 3])
    source = ModelSource("broken", tmp_path, "broken.gguf")
    with pytest.raises(ModelLoadError, match="broken"):
        load_model(
            source, select_backend("torch", torch.device("cpu")), torch.float32, torch.device("cpu")
        )
    (tmp_path / "garbage.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="garbage"):
        tiny_engine(tmp_path / "garbage.gguf")


def _hf_config(directory: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(directory))


def _hf_config_of(source: ModelSource):
    from app.models.loader import load_hf_config

    return load_hf_config(source)


def test_bf16_prepacked_and_fused_layers_match_plain_ones(tmp_path: Path, monkeypatch):
    from app.models import cpu_linear, loader

    # The pinned CPU torch build has oneDNN; its bf16 path needs AVX-512 (or
    # AVX-NE-CONVERT), and must be exercised wherever the CPU has it. Elsewhere the engine
    # runs the plain layers, which the rest of the suite covers.
    directory = save_tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    ids = [3, 17, 99, 4, 250, 8, 8, 61, 12, 140]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    if not cpu_linear.can_prepack(torch.bfloat16, torch.device("cpu")):
        # No such CPU path here: it must be missing for the CPU's sake, and the engine
        # must fall back to plain layers that still generate.
        assert torch.backends.cpu.get_cpu_capability() != "AVX512", "oneDNN bf16 path missing"
        engine = cpu_engine(directory, dtype="bfloat16")
        assert not isinstance(engine.loaded.model.lm_head, cpu_linear.PackedLinear)
        assert len(engine.generate([ids], params)[0].outputs[0].token_ids) == 6
        return
    packed_engine = cpu_engine(directory, dtype="bfloat16")
    assert isinstance(packed_engine.loaded.model.lm_head, cpu_linear.PackedLinear)
    packed = packed_engine.generate([ids], params)[0].outputs[0]
    monkeypatch.setattr(loader, "can_prepack", lambda *a: False)
    plain = cpu_engine(directory, dtype="bfloat16").generate([ids], params)[0].outputs[0]
    first_packed, first_plain = packed.logprobs[0], plain.logprobs[0]
    assert first_packed.token_id == first_plain.token_id
    plain_top = dict(first_plain.top)
    shared = [(t, lp) for t, lp in first_packed.top if t in plain_top]
    assert len(shared) >= 4
    assert all(abs(lp - plain_top[t]) < 0.05 for t, lp in shared)


def test_unreachable_hub_repo_is_a_clear_error(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="someone/no-such-model.*Hugging Face Hub"):
        resolve_model("someone/no-such-model")
