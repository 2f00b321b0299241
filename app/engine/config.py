"""EngineConfig: every knob of one engine, validated once, with the reason for each default.

Importing this module imports no torch: the Ingress, registry, operator and `serve run`
driver validate AppConfig (which holds EngineConfigs) without mapping libtorch. The
properties that resolve torch devices and dtypes import it when first read (in the
engine's processes)."""

import os
from functools import cached_property
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import torch

# Bytes per element of the dtypes a config can name (torch's itemsize for each).
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class SpeculativeConfig(BaseModel):
    """Speculative decoding (app/engine/speculation.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["ngram"] = Field(
        "ngram", description="'ngram': prompt lookup, proposals from the sequence's own tokens."
    )
    num_tokens: int = Field(4, ge=1, le=32, description="Tokens proposed a step at most.")
    max_ngram: int = Field(3, ge=1, le=16, description="Longest suffix looked up.")
    min_ngram: int = Field(1, ge=1, le=16, description="Shortest suffix looked up.")
    max_running: int = Field(
        4,
        ge=1,
        description="Speculate only while at most this many sequences run: a larger batch "
        "already fills the machine.",
    )

    @model_validator(mode="after")
    def _ngrams_ordered(self) -> "SpeculativeConfig":
        if self.min_ngram > self.max_ngram:
            raise ValueError("speculative.min_ngram must be at most max_ngram")
        return self


def check_lora_name(name: str) -> None:
    """ValueError unless `name` may name a LoRA adapter: requests name one as
    `base:adapter`, and `:latest` is Ollama's tag."""
    if not name or ":" in name or name == "latest" or len(name) > 128:
        raise ValueError(f"a LoRA adapter's name may not be {name!r} or hold ':'")


class EngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(
        "default",
        description="'default' (the embedded SmolLM2 GGUF), a .gguf file, an HF directory or a Hub repo id.",
    )
    mmproj: str | None = Field(
        None,
        description="llama.cpp's projector file (mmproj-*.gguf) of a GGUF model: its image "
        "encoder (served: Gemma 3's, SmolVLM's and Qwen2.5-VL's).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="'auto': bfloat16 on CUDA and on CPUs with bf16 instructions, else float32; "
        "float32 on a CPU for a model whose weights stay quantized (the fused decode layers need it).",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    quantization: Literal["auto", "none", "gguf", "int8"] = Field(
        "auto",
        description="'auto': a GGUF file's quantized weights stay as stored on a CPU with the "
        "kernels (one shard), else they are dequantized to `dtype`; 'gguf': the same, or fail; "
        "'none': dequantized to `dtype`; 'int8': every linear layer quantized at load (Q8_0 "
        "blocks).",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="What the KV cache holds: the model's dtype, or float16 or bfloat16 under a "
        "float32 model. 'auto': float16 (llama.cpp's default) for a quantized model that `dtype` "
        "'auto' computes in float32 on a CPU whose kernels read 16 bits in vectors (AVX-512 or "
        "AVX2; half the bytes a step's attention reads, twice the tokens per GiB), else the "
        "model's dtype. Without them a 16-bit cache is read one element at a time: slower.",
    )
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV block.")
    num_kv_blocks: int | None = Field(
        None, ge=2, description="Fixed block count; None sizes the cache from kv_cache_memory_gib."
    )
    kv_cache_memory_gib: float = Field(
        1.0,
        gt=0,
        description="KV cache budget when num_kv_blocks is None (SmolLM2: ~46k tokens per GiB in "
        "16 bits, ~23k in float32).",
    )
    max_num_seqs: int = Field(128, ge=1, description="Most sequences in one step's batch.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget per step; longer prompts are prefilled in chunks."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="None: the model's own context length."
    )
    enable_prefix_caching: bool = True
    kv_offload: Literal["auto", "off", "memory", "disk"] = Field(
        "auto",
        description="A second KV tier (app/engine/kv_tier.py): cached prefix blocks (idle "
        "contexts' included) that the cache reallocates keep their KV there, and are read "
        "back instead of computed. 'memory': host RAM; 'disk': a file in kv_offload_dir; "
        "'auto': pinned host RAM on a GPU, the disk on a CPU (whose RAM is already the "
        "cache); both read back faster than recomputing (bench/warm_state.py). Needs prefix "
        "caching and one shard.",
    )
    kv_offload_gib: float = Field(4.0, ge=0, description="The second tier's size.")
    kv_offload_dir: str | None = Field(
        None, description="Where a disk tier's file goes (unlinked once open); None: the temp dir."
    )
    max_contexts: int = Field(
        1024,
        ge=1,
        description="Persistent contexts (Parrot contexts, llama.cpp slots) kept; past it the "
        "least recently used idle one is dropped.",
    )
    max_context_tokens: int = Field(
        1 << 20,
        ge=1,
        description="Tokens kept across all contexts (about 40 bytes each while evicted); past "
        "it the least recently used idle contexts are dropped.",
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per shard; None shares this machine's cores among the shards.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="Shards the weights are split over (one process or GPU each)."
    )
    distributed_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="auto: NCCL on CUDA, gloo on CPU."
    )
    attention_backend: Literal["auto", "torch", "flash", "triton"] = Field(
        "auto",
        description="auto: FlashAttention on CUDA when flash_attn imports and block_size is a "
        "multiple of 256, else Triton's paged kernels on CUDA when triton imports, else torch "
        "(C++ kernels on CPU, gathers + SDPA on GPU). 'triton' on a CPU runs only under "
        "Triton's interpreter (TRITON_INTERPRET=1): for tests.",
    )
    cuda_graphs: bool = Field(
        True,
        description="On CUDA, decode steps of up to 256 sequences replay CUDA graphs captured "
        "at start-up (one per batch-size bucket; eager launches cost more than a small "
        "model's kernels). Only where a graph can hold the step: one GPU, dense float "
        "layers, the triton or flash attention backend. Ignored on a CPU.",
    )
    structured_outputs: bool = Field(
        True,
        description="Constrained decoding (JSON schemas, regexes, grammars, tool calls); "
        "loads the model's vocabulary for the grammar library at start-up.",
    )
    seed: int = Field(0, description="Seeds the sampler for requests that bring no seed.")
    speculative: SpeculativeConfig | None = Field(
        None,
        description="Speculative decoding for plain requests (greedy or unseeded, no "
        "logprobs, penalties or grammar): null (off) or "
        "{method: ngram, num_tokens, max_ngram, min_ngram, max_running}.",
    )
    max_loras: int = Field(
        4,
        ge=0,
        description="LoRA adapters held at once (least recently used out first); 0: none.",
    )
    loras: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters loaded at start: name -> PEFT directory.",
    )

    @model_validator(mode="after")
    def _loras_fit(self) -> "EngineConfig":
        if len(self.loras) > self.max_loras:
            raise ValueError(f"{len(self.loras)} loras, but max_loras is {self.max_loras}")
        for name in self.loras:
            check_lora_name(name)
        return self

    @model_validator(mode="after")
    def _kv_cache_dtype_fits(self) -> "EngineConfig":
        # with dtype 'auto' the model's dtype is known only at load (load_runner checks)
        if self.dtype != "auto" and self.kv_cache_dtype != "auto":
            _check_kv_cache_dtype_names(self.dtype, self.kv_cache_dtype)
        return self

    @cached_property
    def torch_device(self) -> "torch.device":
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @cached_property
    def torch_dtype(self) -> "torch.dtype":
        """The dtype asked for, 'auto' resolved by the device alone; with 'auto', a model
        whose weights stay quantized computes in float32 on a CPU (load_runner), which
        LoadedModel.dtype and ModelRunner.dtype say."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.torch_device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32

    @cached_property
    def threads(self) -> int:
        cores = len(os.sched_getaffinity(0))
        return self.num_threads or max(1, cores // self.tensor_parallel_size)

    @property
    def torch_distributed_backend(self) -> str:
        if self.distributed_backend != "auto":
            return self.distributed_backend
        return "nccl" if self.torch_device.type == "cuda" else "gloo"


def check_kv_cache_dtype(model: "torch.dtype", cache: "torch.dtype") -> None:
    """A cache holds the model's dtype, or a 16-bit one under float32 (the kernels widen
    what they read to float32; nothing narrower than the model reads wider keys)."""
    _check_kv_cache_dtype_names(
        str(model).removeprefix("torch."), str(cache).removeprefix("torch."), cache.itemsize
    )


def _check_kv_cache_dtype_names(model: str, cache: str, cache_itemsize: int | None = None) -> None:
    """check_kv_cache_dtype on dtype names ('float32', ...), without torch."""
    itemsize = _ITEMSIZE.get(cache) if cache_itemsize is None else cache_itemsize
    if cache != model and not (model == "float32" and itemsize == 2):
        raise ValueError(
            f"kv_cache_dtype {cache!r} is not supported for a "
            f"{model} model: the model's dtype, or float16 or "
            "bfloat16 under float32"
        )


def cpu_has_bf16() -> bool:
    """True when the CPU computes bfloat16 natively (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
