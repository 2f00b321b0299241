"""Which attention backend a model runs on: the choice by name and device, each backend
imported only when chosen (flash_attn and triton are optional, and Triton's interpreter
must be set before its kernels are first imported)."""

import os

import torch

from app.models.attention import AttentionBackend


def select_backend(name: str, device: torch.device, block_size: int = 16) -> AttentionBackend:
    """'flash': FlashAttention-2 (CUDA, flash_attn installed, block_size a multiple of 256).
    'triton': Triton kernels over the torch backend's layout (CUDA; on a CPU only under
    Triton's interpreter, TRITON_INTERPRET=1, for tests). 'torch': C++ kernels on CPU,
    gathers + SDPA elsewhere. 'auto': flash where it can run, else triton on CUDA, else
    torch."""
    from app.models.flash_attention import PAGE_MULTIPLE, FlashAttentionBackend
    from app.models.flash_attention import flash_attn_available as flash_ok
    from app.models.torch_attention import TorchPagedAttention

    if name == "flash":
        if device.type != "cuda" or not flash_ok():
            raise ValueError("attention backend 'flash' needs CUDA and the flash_attn package")
        return FlashAttentionBackend(block_size)
    if name == "auto" and device.type == "cuda" and block_size % PAGE_MULTIPLE == 0 and flash_ok():
        return FlashAttentionBackend(block_size)
    if name == "triton":
        _check_triton(device)
        return _triton_backend()
    if name == "auto" and device.type == "cuda" and _triton_imports():
        return _triton_backend()
    if name in ("auto", "torch"):
        return TorchPagedAttention(device)
    raise ValueError(
        f"attention backend {name!r} is not available (have: auto, torch, flash, triton)"
    )


def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _check_triton(device: torch.device) -> None:
    if not _triton_imports():
        raise ValueError("attention backend 'triton' needs the triton package")
    if device.type == "cuda":
        return
    # The interpreter is chosen when a kernel is decorated, so it must be set before the
    # kernels' module is first imported.
    if device.type != "cpu" or os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention backend 'triton' needs CUDA; on a CPU it runs only under Triton's "
            "interpreter (TRITON_INTERPRET=1 before triton is imported), which is for tests"
        )


def _triton_backend() -> AttentionBackend:
    from app.models.triton_attention import TritonPagedAttention

    return TritonPagedAttention()
