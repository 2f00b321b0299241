"""C++ kernels for CPU inference (paged attention, KV-cache writes, RMSNorm, RoPE),
compiled by scripts/setup.sh or on first use (app.models.kernel_build, about 40 s once per
machine and source) and cached under ~/.cache/torch_extensions.

`load()` returns the compiled module, or None when there is no compiler, the build
fails, or SHOAL_CPU_KERNELS=0; callers then fall back to plain torch.
"""

import hashlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

from app.models.kernel_build import build_extension, cpu_signature

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


SOURCES = ("kernels.cpp", "decode_attention.h", "norm_rope.h", "silu_mul.h", "vector_math.h")


def _build_signature() -> str:
    """CPU flags and sources in one hash, for the build's cache name: -march=native makes a
    build valid only on CPUs with the same features, and an edited source must not find
    an older build of itself under the same name."""
    digest = hashlib.sha1(cpu_signature())
    for name in SOURCES:
        digest.update(Path(__file__).with_name(name).read_bytes())
    return digest.hexdigest()[:10]


def load() -> ModuleType | None:
    global _module, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("SHOAL_CPU_KERNELS", "1") == "0":
            return None
        try:
            source = Path(__file__).with_name("kernels.cpp")
            _module = build_extension(
                f"shoal_cpu_kernels_{_build_signature()}",
                [str(source)],
                ["-O3", "-march=native", "-fopenmp"],
                ["-fopenmp"],
            )
        except Exception as exc:  # no compiler, no headers: the torch path still works
            logger.warning("CPU paged-attention kernels unavailable, using torch ops: %s", exc)
            _module = None
        return _module
