"""C++ kernels for the CPU decode path, compiled on first use (cached by torch).

`load()` returns the compiled module, or None when there is no compiler, the build
fails, or SHOAL_CPU_KERNELS=0; callers then fall back to plain torch.
"""

import logging
import os
import threading
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def load() -> ModuleType | None:
    global _module, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("SHOAL_CPU_KERNELS", "1") == "0":
            return None
        try:
            from torch.utils.cpp_extension import load as build

            source = Path(__file__).with_name("paged_attention.cpp")
            _module = build(
                name="shoal_cpu_paged_attention",
                sources=[str(source)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no headers: the torch path still works
            logger.warning("CPU paged-attention kernels unavailable, using torch ops: %s", exc)
            _module = None
        return _module
