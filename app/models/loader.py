"""load_model: config, architecture check, weights, dtype and device, in one call."""

import logging
from dataclasses import dataclass
from typing import Any

import torch

from app.models.arch import ArchConfig
from app.models.attention import AttentionBackend
from app.models.cpu_linear import can_prepack, prepack_linears
from app.models.decoder import DecoderForCausalLM, rotary_tables
from app.models.parallel import TPGroup, check_divisible
from app.models.source import ModelSource
from app.models.weight_loading import expected_pieces, load_weights
from app.models.weights import iter_weights, patch_gguf_config
from app.protocol.errors import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: DecoderForCausalLM
    arch: ArchConfig
    source: ModelSource
    max_model_len: int


def load_hf_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    try:
        if source.is_gguf:
            config = AutoConfig.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
            return patch_gguf_config(config, source)  # what transformers' reader loses
        return AutoConfig.from_pretrained(str(source.directory))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(source.name, f"cannot read its config: {exc}") from exc


def read_arch(source: ModelSource) -> ArchConfig:
    return ArchConfig.from_hf(load_hf_config(source), source.name)


def load_model(
    source: ModelSource,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None = None,
    tp: TPGroup = TPGroup(),  # noqa: B008 (frozen)
) -> LoadedModel:
    """Load weights into our model. `max_model_len` (None: the model's own) sizes the
    RoPE tables and is capped at the model's context length."""
    arch = read_arch(source)
    if tp.enabled:
        try:
            check_divisible(arch, tp.size)
        except ValueError as exc:
            raise ModelLoadError(source.name, str(exc)) from exc
    max_positions = min(max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    with torch.device("meta"):
        model = DecoderForCausalLM(arch, backend, max_positions, tp)
    # Materialise on the target device without initialising (weights come next);
    # the RoPE tables are buffers computed at construction, so rebuild them for real.
    model = model.to_empty(device=device)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _rebuild_rope(model, arch, max_positions, device)
    try:
        loaded = load_weights(model, iter_weights(source, arch), tp)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(source.name, f"corrupt or mismatched weights: {exc}") from exc
    missing = expected_pieces(model) - loaded
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise ModelLoadError(
            source.name, f"{len(missing)} weights missing from the checkpoint: {shown}"
        )
    model = _ready(model, arch, dtype, device)
    logger.info("loaded %s (%s, %s) on %s", source.name, arch.architecture, dtype, device)
    return LoadedModel(model=model, arch=arch, source=source, max_model_len=max_positions)


def random_model(
    source: ModelSource,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None = None,
    std: float = 0.02,
) -> LoadedModel:
    """The model `source`'s config describes, with random weights drawn on `device`: for
    benchmarks of shapes whose weights cannot be carried (an 8B model on a machine
    without network). Only `source`'s config.json is read."""
    arch = read_arch(source)
    max_positions = min(max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    with torch.device("meta"):
        model = DecoderForCausalLM(arch, backend, max_positions)
    model = model.to(dtype=dtype).to_empty(device=device)  # never materialised in float32
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _rebuild_rope(model, arch, max_positions, device)
    model = _ready(model, arch, dtype, device)
    return LoadedModel(model=model, arch=arch, source=source, max_model_len=max_positions)


def _ready(
    model: DecoderForCausalLM, arch: ArchConfig, dtype: torch.dtype, device: torch.device
) -> DecoderForCausalLM:
    """In `dtype` for inference; RoPE tables float32; bf16 linears prepacked on CPU."""
    model = model.to(dtype=dtype)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for rotary in (model.model.rotary, model.model.rotary_local):
        if rotary is not None:
            rotary.float()  # cos/sin stay float32 whatever the model dtype
    model.eval().requires_grad_(False)
    if can_prepack(dtype, device):
        prepack_linears(model)
    return model


def _rebuild_rope(
    model: DecoderForCausalLM, arch: ArchConfig, max_positions: int, device: torch.device
) -> None:
    with torch.device(device):
        model.model.rotary, model.model.rotary_local = rotary_tables(arch, max_positions)
