"""ModelRunner: owns the model and its KV cache; turns a scheduled batch into logits."""

import logging

import torch
from torch import nn

from app.engine.config import EngineConfig, check_kv_cache_dtype
from app.engine.decode_graphs import DecodeGraphs
from app.engine.input_batch import InputBatch, StepInputs
from app.engine.scheduler import ScheduledBatch
from app.engine.sequence import Sequence
from app.models.attention import AttentionBackend
from app.models.attention_backends import select_backend
from app.models.decoder import (
    Attention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderModel,
    RMSNorm,
)
from app.models.dense_mlp import DenseMLP
from app.models.loader import LoadedModel, images_need_both_ways, load_model
from app.models.parallel import TPGroup
from app.models.quantized_model import quantized_bytes
from app.models.rope import RotaryEmbedding
from app.models.source import resolve_model
from app.models.torch_attention import TorchPagedAttention
from app.models.triton_attention import TritonPagedAttention

logger = logging.getLogger(__name__)

# What a CUDA graph of a decode step may hold: no routing on values (experts), no
# quantized kernels, no host work inside the forward.
GRAPH_SAFE_MODULES = frozenset(
    (
        DecoderForCausalLM,
        DecoderModel,
        DecoderLayer,
        Attention,
        RMSNorm,
        DenseMLP,
        RotaryEmbedding,
        nn.Linear,
        nn.Embedding,
        nn.ModuleList,
    )
)


def kv_bytes_per_block(model: DecoderForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    arch = model.local  # this shard's KV heads
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype.itemsize
    return per_token * block_size


def kv_cache_dtype(
    config: EngineConfig, loaded: LoadedModel, backend: AttentionBackend
) -> torch.dtype:
    """The KV cache's element type (EngineConfig.kv_cache_dtype). 'auto' stores a
    quantized model's keys and values in float16, as llama.cpp does, where it computes in
    float32 (`dtype` 'auto' on a CPU) and the kernels read 16 bits in vectors (one
    conversion instruction per 16 or 8): at 32 sequences a step's attention then read
    half the bytes and took 40% less time with AVX-512, 22-36% with AVX2 (its build on
    the same machine). float16's 10 significant bits cost less than bfloat16's 7
    (perplexity +0.3% against +0.5% on the default GGUF). A float model, and a float32
    `dtype` asked for, keep their own dtype."""
    model = loaded.dtype
    if config.kv_cache_dtype == "auto":
        fast_16 = isinstance(backend, TorchPagedAttention) and backend.reads_16_bit_cache_fast
        quantized = quantized_bytes(loaded.model) > 0  # never under TP: shards dequantize
        if config.dtype == "auto" and model == torch.float32 and fast_16 and quantized:
            return torch.float16
        return model
    dtype = getattr(torch, config.kv_cache_dtype)
    check_kv_cache_dtype(model, dtype)
    # Both widen what they read to float32; FlashAttention reads the model's dtype only.
    widening = (TorchPagedAttention, TritonPagedAttention)
    if dtype != model and not isinstance(backend, widening):
        raise ValueError(
            f"the {backend.name} attention backend keeps the model's dtype in its cache"
        )
    return dtype


def num_kv_blocks(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype) -> int:
    """Blocks in the cache; every shard computes the same number from the same config."""
    return config.num_kv_blocks or max(
        2,
        int(config.kv_cache_memory_gib * 2**30)
        // kv_bytes_per_block(loaded.model, config.block_size, dtype),
    )


def load_runner(
    config: EngineConfig,
    tp: TPGroup = TPGroup(),  # noqa: B008 (frozen)
    loaded: LoadedModel | None = None,
) -> tuple[LoadedModel, "ModelRunner"]:
    """This shard's slice of the model (rank `tp.rank`; the whole model without TP) and a
    fresh KV cache sized from `config`: what the engine (rank 0) and every other shard
    run. `loaded` reuses weights already in memory (another engine's, in tests); the KV
    cache is always new."""
    if loaded is None:
        source = resolve_model(config.model)
        name = config.attention_backend
        if name == "auto" and images_need_both_ways(source, config.mmproj):
            name = "torch"  # the one whose prefills mask Gemma 3's images both ways
            logger.info("%s: attention backend torch, for its images' both-ways mask", source.name)
        backend = select_backend(name, config.torch_device, config.block_size)
        device = config.torch_device
        # 'auto' computes quantized weights' layers on a CPU in float32, as the fused
        # decode layers need: on an AVX512-BF16 CPU, where 'auto' means bfloat16, the
        # default model took 5.0-6.0 ms a token in bfloat16 and 3.5-3.7 ms in float32.
        quantized_dtype = torch.float32 if config.dtype == "auto" and device.type == "cpu" else None
        loaded = load_model(
            source,
            backend,
            config.torch_dtype,
            device,
            config.max_model_len,
            tp,
            config.quantization,
            quantized_dtype,
            config.mmproj,
        )
    else:
        backend = loaded.model.model.layers[0].self_attn.backend
    kv_dtype = kv_cache_dtype(config, loaded, backend)
    runner = ModelRunner(config, loaded, backend, num_kv_blocks(config, loaded, kv_dtype), kv_dtype)
    return loaded, runner


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        backend: AttentionBackend,
        num_blocks: int,
        kv_dtype: torch.dtype,
    ) -> None:
        model = self.model = loaded.model
        self.backend = backend
        self.num_blocks = num_blocks  # the block manager's; the cache holds one more
        self.scratch_block = num_blocks  # written only by a padded decode (DecodeGraphs)
        self.block_size = config.block_size
        self.device = config.torch_device
        self.dtype = loaded.dtype  # what the model computes in
        self.kv_dtype = kv_dtype  # what its cache holds
        arch = model.local
        shape = backend.kv_cache_shape(
            num_blocks + 1, config.block_size, arch.num_kv_heads, arch.head_dim
        )
        self.num_kv_heads = arch.num_kv_heads
        self.max_num_seqs = config.max_num_seqs
        self.max_blocks = -(-loaded.max_model_len // config.block_size)
        self.inputs = InputBatch(config.max_num_seqs, self.max_blocks, config.block_size)
        self.decode_graphs: DecodeGraphs | None = None
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        for _ in model.model.layers:
            self.k_caches.append(torch.zeros(shape, dtype=kv_dtype, device=self.device))
            self.v_caches.append(torch.zeros(shape, dtype=kv_dtype, device=self.device))
        logger.info(
            "KV cache: %d blocks of %d tokens, %s per layer in %s",
            num_blocks,
            self.block_size,
            shape,
            kv_dtype,
        )
        if config.cuda_graphs and self.device.type == "cuda":
            self.use_decode_graphs(capture=True)

    def use_decode_graphs(self, capture: bool) -> bool:
        """Run all-decode steps through DecodeGraphs' static buffers, replaying captured
        CUDA graphs when `capture` (else eagerly: the CPU tests' path), which only models
        `graph_unsafe_reason` accepts may do; False when not used, and why is logged."""
        reason = graph_unsafe_reason(self.model) if capture else None
        if reason is None:
            try:
                graphs = DecodeGraphs(
                    self.model,
                    self.backend,
                    self.max_num_seqs,
                    self.max_blocks,
                    self.scratch_block,
                    self.block_size,
                    self.device,
                )
            except NotImplementedError as exc:
                reason = str(exc)
        if reason is not None:
            logger.info("decode steps run eagerly: %s", reason)
            return False
        self._bind_caches()
        if capture:
            graphs.capture()
        self.decode_graphs = graphs
        return True

    def prepare(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Sequence]]:
        """A scheduled batch's inputs (read from its sequences: the caller holds them
        still), and the sequences whose next token is due, in logits-row order."""
        return self.inputs.prepare(batch)

    def run(self, step: StepInputs) -> torch.Tensor:
        """Run one forward pass. Returns logits (S, vocab) in the model's dtype, on the
        model's device (the sampler runs there), one row per due sequence. With tensor
        parallelism the step's inputs go to every shard first."""
        self.model.tp.broadcast_object(step)
        return self.execute(step)

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> torch.Tensor:
        """The forward pass on this shard; logits on rank 0, an empty tensor elsewhere."""
        self._bind_caches()
        if step.copies:
            self._copy_blocks(step.copies)
        graphable = step.images is None and step.lora is None and step.positions.dim() == 1
        if self.decode_graphs is not None and graphable and self.decode_graphs.fits(step):
            return self.decode_graphs.run(step)
        metadata = self.backend.build_metadata(step.layout, self.num_kv_heads, self.device)
        images = None
        if step.images is not None:
            images = (self._to_device(step.images[0]), step.images[1].to(self.device))
        return self.model(
            self._to_device(step.input_ids),
            self._to_device(step.positions),
            metadata,
            self._to_device(step.logits_rows),
            images,
            None if step.lora is None else step.lora.to(self.device),
        )

    def _to_device(self, values: torch.Tensor) -> torch.Tensor:
        """Step inputs to the device; on CUDA through pinned memory, without blocking."""
        if self.device.type != "cuda":
            return values
        return values.pin_memory().to(self.device, non_blocking=True)

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """(layers, 2, len(blocks), ...) copies of those blocks' K and V, on the CPU."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        pairs = zip(self.k_caches, self.v_caches, strict=True)
        return torch.stack([torch.stack([k[index], v[index]]) for k, v in pairs]).cpu()

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        """The inverse of `read_blocks`: `kv` (layers, 2, len(blocks), ...) into them."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        for layer, (k, v) in enumerate(zip(self.k_caches, self.v_caches, strict=True)):
            k[index] = kv[layer, 0].to(self.device, k.dtype)
            v[index] = kv[layer, 1].to(self.device, v.dtype)

    def _bind_caches(self) -> None:
        # Bound per run so engines may share one model's weights, but only when another
        # engine (or none) bound them last: the stores go through Module.__setattr__, two
        # per layer, ~0.7 ms of a 7 ms decode step on SmolLM2. The layers are always bound
        # together, so the first layer's key cache tells whose they are.
        first = self.model.model.layers[0].self_attn
        if first.__dict__.get("k_cache") is self.k_caches[0]:
            return
        for layer, k, v in zip(self.model.model.layers, self.k_caches, self.v_caches, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k, v in zip(self.k_caches, self.v_caches, strict=True):
            self.backend.copy_blocks(k, v, src, dst)


def graph_unsafe_reason(model: DecoderForCausalLM) -> str | None:
    """Why a captured graph could not replay this model's decode step, or None. An
    allowlist of the modules a graph is known to hold (dense layers of float weights,
    one device), so that a new kind of layer never reaches a graph untested."""
    if model.tp.enabled:
        return "tensor parallelism (its collectives are not captured)"
    for module in model.modules():
        if type(module) not in GRAPH_SAFE_MODULES:  # exact types: a subclass may differ
            return f"{type(module).__name__} layers"
    return None
