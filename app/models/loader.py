"""load_model: config, architecture check, weights, dtype and device, in one call."""

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from app.models.arch import ArchConfig
from app.models.attention import AttentionBackend
from app.models.cpu_linear import can_prepack, prepack_linears
from app.models.decoder import DecoderForCausalLM, rotary_tables
from app.models.families import read_arch_config
from app.models.gguf_configs import add_gguf_configs
from app.models.gguf_reader import quick_gguf_reads
from app.models.parallel import TPGroup, check_divisible
from app.models.quant.fused_decode import fuse_decode_layers
from app.models.quantized_model import (
    allow_inexact_float32,
    install,
    quantize_linears,
    quantized_bytes,
    quantized_targets,
    set_output_dtype,
)
from app.models.source import ModelSource
from app.models.torch_attention import TorchPagedAttention
from app.models.vision.loading import ENCODERS, load_vision
from app.models.weight_loading import expected_pieces, load_weights
from app.models.weights import iter_weights, patch_gguf_config, reading_gguf_once
from app.protocol.errors import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: DecoderForCausalLM
    arch: ArchConfig
    source: ModelSource
    max_model_len: int
    dtype: torch.dtype  # what it computes in: `dtype`, or `quantized_dtype` (load_model)
    vision: torch.nn.Module | None = None  # the image encoder, rank 0 only (vision/)


def load_hf_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    try:
        if source.is_gguf:
            quick_gguf_reads()
            add_gguf_configs()
            config = AutoConfig.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
            return patch_gguf_config(config, source)  # what transformers' reader loses
        return AutoConfig.from_pretrained(str(source.directory))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(source.name, f"cannot read its config: {exc}") from exc


def read_arch(source: ModelSource) -> ArchConfig:
    return read_arch_config(load_hf_config(source), source.name)


@reading_gguf_once()
def load_model(
    source: ModelSource,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None = None,
    tp: TPGroup = TPGroup(),  # noqa: B008 (frozen)
    quantization: str = "none",
    quantized_dtype: torch.dtype | None = None,
    mmproj: str | None = None,
) -> LoadedModel:
    """Load weights into our model. `max_model_len` (None: the model's own) sizes the
    RoPE tables and is capped at the model's context length. `quantization` (see
    EngineConfig): "none" computes in `dtype` throughout; "auto"/"gguf" keep a GGUF's
    quantized weights as stored; "int8" quantizes every linear layer at load. A model
    with quantized weights computes in `quantized_dtype` where one is given. `mmproj`:
    llama.cpp's projector file, the image encoder of a GGUF model."""
    arch = read_arch(source)
    if tp.enabled:
        try:
            check_divisible(arch, tp.size)
        except ValueError as exc:
            raise ModelLoadError(source.name, str(exc)) from exc
    max_positions = min(max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    with torch.device("meta"):
        model = DecoderForCausalLM(arch, backend, max_positions, tp)
    keep = kept_quantized_types(quantization, source, device, tp)
    targets: set[str] = set()
    if keep:
        tied = arch.tie_word_embeddings
        targets = quantized_targets(iter_weights(source, arch, keep), model, tied)
        install(model, targets, tied)
    if quantized_dtype is not None and (targets or quantization == "int8"):
        dtype = quantized_dtype
    # Materialise on the target device without initialising (weights come next);
    # the RoPE tables are buffers computed at construction, so rebuild them for real.
    model = model.to_empty(device=device)
    _tie(model, arch)
    _rebuild_rope(model, arch, max_positions, device)
    try:
        loaded = load_weights(model, iter_weights(source, arch, keep), tp)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(source.name, f"corrupt or mismatched weights: {exc}") from exc
    _check_complete(model, loaded, source)
    if quantization == "int8":
        if device.type != "cpu" or tp.enabled:
            raise ModelLoadError(source.name, "quantization 'int8' runs on one CPU shard only")
        model = model.to(dtype=dtype)
        quantize_linears(model)
    if quantized_bytes(model):  # an F32/F16 GGUF keeps transformers' exact float32 ops
        allow_inexact_float32(model)
        if isinstance(backend, TorchPagedAttention):
            backend.token_by_token = True  # batch invariance (app/models/quant/__init__.py)
    model = _ready(model, arch, dtype, device)
    if quantized_bytes(model):
        fuse_decode_layers(model)
    logger.info(
        "loaded %s (%s, %s, quantization %s, %.0f MB of quantized weights) on %s",
        source.name,
        arch.architecture,
        dtype,
        quantization if keep or quantization == "int8" else "none",
        quantized_bytes(model) / 1e6,
        device,
    )
    vision = _vision(source, backend, dtype, device, mmproj) if tp.rank == 0 else None
    return LoadedModel(model, arch, source, max_positions, dtype, vision)


def images_need_both_ways(source: ModelSource, mmproj: str | None = None) -> bool:
    """Whether the checkpoint's images need attention that sees an image's tokens both
    ways (Gemma 3's), which only the torch backend masks (`auto` then picks it)."""
    if mmproj is not None:
        from app.models.vision.mmproj import read_mmproj

        return read_mmproj(mmproj, source.name)[0] == "gemma3"
    if source.is_gguf:
        return False
    archs = getattr(load_hf_config(source), "architectures", None) or []
    return any(getattr(ENCODERS.get(a), "bidirectional", False) for a in archs)


def _vision(
    source: ModelSource,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    mmproj: str | None,
) -> nn.Module | None:
    """The checkpoint's image encoder, where the attention backend can serve its images."""
    vision = load_vision(source, load_hf_config(source), dtype, device, mmproj)
    if getattr(vision, "bidirectional", False) and not backend.sees_both_ways:
        logger.warning(
            "%s: its images need attention that sees an image's tokens both ways, which the "
            "%s backend does not: serving text only (attention_backend: torch reads images)",
            source.name,
            backend.name,
        )
        return None
    return vision


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
    return LoadedModel(
        model=model, arch=arch, source=source, max_model_len=max_positions, dtype=dtype
    )


def _ready(
    model: DecoderForCausalLM, arch: ArchConfig, dtype: torch.dtype, device: torch.device
) -> DecoderForCausalLM:
    """In `dtype` for inference; RoPE tables float32; bf16 linears prepacked on CPU."""
    model = model.to(dtype=dtype)
    _tie(model, arch)
    set_output_dtype(model, dtype)
    for rotary in (model.model.rotary, model.model.rotary_local):
        if rotary is not None:
            rotary.float()  # cos/sin stay float32 whatever the model dtype
    model.eval().requires_grad_(False)
    if can_prepack(dtype, device):
        prepack_linears(model)
    return model


def kept_quantized_types(
    quantization: str, source: ModelSource, device: torch.device, tp: TPGroup
) -> frozenset[int]:
    """The GGML types whose weights stay quantized: those our CPU kernels run, for a GGUF
    file on one CPU shard. `auto` falls back to dequantizing (and says so) where that
    cannot be; `gguf` refuses to."""
    from app.models import quant

    if quantization not in ("auto", "gguf"):
        return frozenset()
    reason = None
    if not source.is_gguf:
        reason = "the model is not a GGUF file"
    elif device.type != "cpu":
        reason = f"quantized kernels run on CPU, not {device.type}"
    elif tp.enabled:
        reason = "quantized weights are not split across tensor-parallel shards"
    elif not quant.available():
        reason = "the quantized CPU kernels could not be built"
    if reason is None:
        return frozenset(int(t) for t in quant.QuantType)
    if quantization == "gguf":
        raise ModelLoadError(source.name, f"quantization 'gguf' impossible: {reason}")
    if source.is_gguf:
        logger.info("%s: dequantizing the GGUF weights (%s)", source.name, reason)
    return frozenset()


def _check_complete(model: DecoderForCausalLM, loaded: set[str], source: ModelSource) -> None:
    missing = expected_pieces(model) - loaded
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise ModelLoadError(
            source.name, f"{len(missing)} weights missing from the checkpoint: {shown}"
        )


def _tie(model: DecoderForCausalLM, arch: ArchConfig) -> None:
    """The LM head shares the embedding's weight (a quantized embedding's head reads it
    through QuantLinear.tied)."""
    if arch.tie_word_embeddings and isinstance(model.model.embed_tokens, torch.nn.Embedding):
        model.lm_head.weight = model.model.embed_tokens.weight


def _rebuild_rope(
    model: DecoderForCausalLM, arch: ArchConfig, max_positions: int, device: torch.device
) -> None:
    with torch.device(device):
        model.model.rotary, model.model.rotary_local = rotary_tables(arch, max_positions)
