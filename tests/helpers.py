"""Builders shared by the tests (and benchmarks): tiny random checkpoints, engines over
them, and tensor-parallel shards as local processes."""

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from app.engine import EngineConfig, LLMEngine

TINY_VOCAB = 256
TINY_EOS = 255


def save_tiny_checkpoint(
    directory: Path,
    architecture: str = "llama",
    max_shard_size: str | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a random HF checkpoint (config.json + safetensors) of a tiny model."""
    import transformers

    kinds = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = kinds[architecture]
    settings: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=TINY_EOS,
        bos_token_id=0,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def tiny_engine(checkpoint: Path, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = dict(
        model=str(checkpoint), dtype="float32", num_kv_blocks=64, block_size=4, num_threads=2
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def cpu_engine(checkpoint: Path, **overrides: Any) -> LLMEngine:
    """tiny_engine on the CPU, for the CPU's own paths (quantized weights, fused decode
    layers, oneDNN packing), which a GPU host would otherwise never take."""
    return tiny_engine(checkpoint, device="cpu", **overrides)


def tiny_config(checkpoint: Path | str, **overrides: Any) -> EngineConfig:
    """An EngineConfig over a tiny checkpoint, one thread (for engine processes and shards,
    which share the machine's cores with the test)."""
    settings: dict[str, Any] = dict(
        model=str(checkpoint), dtype="float32", num_kv_blocks=64, block_size=4, num_threads=1
    )
    settings.update(overrides)
    return EngineConfig(**settings)


# ---- tensor-parallel shards as plain processes -------------------------------------------
def assert_close_outputs(ours: list, reference: list, tol: float) -> None:
    """The same tokens, each log-probability within `tol` (CompletionOutputs)."""
    for a, b in zip(ours, reference, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) < tol


def free_local_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def spawn_local_shards(config: EngineConfig, master: str) -> list[subprocess.Popen]:
    """Ranks 1..N-1 as `python -m app.engine.shard` processes on this machine (tests and
    benchmarks; Serve replicas use ShardActors instead)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env["OMP_NUM_THREADS"] = str(config.threads)
    return [
        subprocess.Popen(
            [sys.executable, "-m", "app.engine.shard", "--rank", str(rank)]
            + ["--master", master, "--config", config.model_dump_json()],
            env=env,
        )
        for rank in range(1, config.tensor_parallel_size)
    ]


def stop_local_shards(shards: list[subprocess.Popen], timeout_s: float = 15.0) -> None:
    """Wait for shards that rank 0 told to stop; kill the ones that do not."""
    for shard in shards:
        try:
            shard.wait(timeout_s)
        except subprocess.TimeoutExpired:
            shard.kill()
            shard.wait()


def dense_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    causal_offset: int,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention computed densely in float32, the reference for the paged backends.
    q: (Lq, nh, hd) at positions causal_offset..; keys/values: (L, nkv, hd). Key j is
    visible to the query at p iff j <= p and (with a window) p - j < window; scores are
    capped (softcap * tanh(s / softcap)) before masking."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).float()  # (L, nh, hd)
    v = values.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * q.shape[-1] ** -0.5
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    p = causal_offset + torch.arange(q.shape[0])[:, None]
    j = torch.arange(keys.shape[0])[None, :]
    visible = (j <= p) & ((p - j < window) if window > 0 else True)
    scores = scores.masked_fill(~visible[None], float("-inf"))  # (nh, Lq, L)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids of a one-message chat turn under the tokenizer's template, ready to reply."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
    )
    return list(rendered["input_ids"])
