"""Tensor iterators over checkpoints: HF safetensors (sharded or not) and GGUF."""

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.models.arch import ArchConfig
from app.models.quantized_tensor import QuantizedTensor
from app.models.source import ModelSource
from app.protocol.errors import ModelLoadError


def iter_weights(
    source: ModelSource, arch: ArchConfig, keep_quantized: frozenset[int] = frozenset()
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """A checkpoint's tensors under our names; GGUF weights in a type of `keep_quantized`
    stay quantized (see iter_gguf)."""
    from app.models.families import hf_tensors

    if source.is_gguf:
        return hf_tensors(iter_gguf(source, arch, keep_quantized), arch, norm_offset=False)
    return hf_tensors(iter_safetensors(source), arch)


def safetensors_files(source: ModelSource) -> list[Path]:
    index = source.directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(source.name, f"corrupt index {index.name}: {exc}") from exc
        files = [source.directory / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(source.directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(source.name, f"no *.safetensors files in {source.directory}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(source.name, f"missing weight files: {', '.join(missing)}")
    return files


def iter_safetensors(
    source: ModelSource, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, or only those whose names are `wanted` (the others are
    never read from disk)."""
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(source):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if wanted is None or wanted(name):
                        yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(source.name, f"corrupt weights in {path.name}: {exc}") from exc


def patch_gguf_config(hf_config: Any, source: ModelSource) -> Any:
    """transformers' config of a GGUF file with what its reader loses put back from the
    file's metadata (see gguf_names.patch_config)."""
    from app.models.gguf_names import patch_config

    return patch_config(hf_config, _gguf_reader(source), source.name)


# A load reads a GGUF file's header up to three times (config, quantized targets,
# weights); parsing a 49k-token vocabulary takes a while (SmolLM2's: 0.5 s, 2 s with
# gguf's own reader), so within `reading_gguf_once` (a context or a decorator) each
# file is parsed once. Only for the load: a reader kept afterwards would keep the whole file
# mapped into the replica.
_readers: ContextVar[dict[Path, Any] | None] = ContextVar("gguf_readers", default=None)


@contextmanager
def reading_gguf_once() -> Iterator[None]:
    token = _readers.set({})
    try:
        yield
    finally:
        _readers.reset(token)


def _gguf_reader(source: ModelSource) -> Any:
    import gguf

    from app.models.gguf_reader import quick_gguf_reads

    quick_gguf_reads()
    path = source.directory / str(source.gguf_file)
    readers = _readers.get()
    if readers is not None and path in readers:
        return readers[path]
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises bare ValueErrors/struct errors on bad files
        raise ModelLoadError(source.name, f"corrupt GGUF file {path.name}: {exc}") from exc
    if readers is not None:
        readers[path] = reader
    return reader


def iter_gguf(
    source: ModelSource, arch: ArchConfig, keep_quantized: frozenset[int] = frozenset()
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The file's tensors under HF names, with llama.cpp's edits undone: q/k rows
    un-permuted (its llama converter, for Llama, Mistral and Mixtral, is the one that
    permutes them) and stacked experts split. Gemma's norms stay as stored: llama.cpp
    stores them as 1 + w, as our decoder wants them. Weight matrices in a type of
    `keep_quantized` (GGML type ids) come as QuantizedTensors, their bytes as stored."""
    import gguf

    from app.models.gguf_names import hf_name

    reader = _gguf_reader(source)
    gguf_arch = reader.fields["general.architecture"].contents()
    permuted = gguf_arch == "llama"
    for tensor in reader.tensors:
        try:
            name = hf_name(tensor.name, gguf_arch)
        except KeyError:
            raise ModelLoadError(
                source.name, f"unknown tensor {tensor.name} in a {gguf_arch!r} GGUF file"
            ) from None
        if name is None:
            continue
        kept = int(tensor.tensor_type) in keep_quantized
        if kept and "{expert}" in name and len(tensor.shape) == 3:
            # (E, rows, bytes per row): each expert's rows as the file stores them
            raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, order="C", copy=True))
            for e in range(raw.shape[0]):
                yield (
                    name.format(expert=e),
                    QuantizedTensor(raw[e], int(tensor.tensor_type), int(tensor.shape[0])),
                )
            continue
        if kept and len(tensor.shape) == 2 and "{expert}" not in name:
            raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, order="C", copy=True))
            weight = QuantizedTensor(raw, int(tensor.tensor_type), int(tensor.shape[0]))
            if permuted and ".q_proj." in name:
                weight = weight.with_rows(unpermute(weight.data, arch.num_heads))
            elif permuted and ".k_proj." in name:
                weight = weight.with_rows(unpermute(weight.data, arch.num_kv_heads))
            yield name, weight
            continue
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ModelLoadError(source.name, f"cannot decode tensor {tensor.name}: {exc}") from exc
        weights = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
        if permuted and ".q_proj." in name:
            weights = unpermute(weights, arch.num_heads)
        elif permuted and ".k_proj." in name:
            weights = unpermute(weights, arch.num_kv_heads)
        if "{expert}" in name:  # (E, ...) -> one tensor per expert
            for e, expert in enumerate(weights):
                yield name.format(expert=e), expert
        elif name.endswith("shared_expert_gate.weight"):
            yield name, weights.reshape(1, -1)  # llama.cpp may store it as a vector
        else:
            yield name, weights


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A q or k projection's rows (and a LoRA adapter's B for it) as HF orders them."""
    # Inverse of llama.cpp's convert permute: (nh, 2, hd/2, ...) <- (nh, hd/2, 2, ...)
    shape = w.shape
    return (
        w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)
    )
