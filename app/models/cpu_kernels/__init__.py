"""C++ kernels for CPU inference (paged attention, KV-cache writes, RMSNorm, RoPE),
compiled by scripts/setup.sh or on first use (app.models.kernel_build, about 40 s once per
machine and source) and cached under ~/.cache/torch_extensions.

`load()` returns the compiled module (`load("avx2")`: the build a CPU without AVX-512
gets, for tests), or None when there is no compiler, the build fails, or
SHOAL_CPU_KERNELS=0; callers then fall back to plain torch.
"""

import hashlib
import logging
from pathlib import Path
from types import ModuleType
from typing import Literal

from app.models.kernel_build import Builds, build_extension, cpu_signature

logger = logging.getLogger(__name__)


SOURCES = ("kernels.cpp", "decode_attention.h", "norm_rope.h", "silu_mul.h", "vector_math.h")

# The builds: "native" (the CPU's own, what serving uses) and "avx2", what a CPU without
# AVX-512 builds, compiled on an AVX-512 CPU only by tests: there its attention code is
# otherwise never compiled.
Build = Literal["native", "avx2"]
_BUILD_FLAGS: dict[str, list[str]] = {
    "native": [],
    "avx2": ["-mno-avx512f"],  # and with it every AVX-512 extension
}


def _build_signature(build: Build = "native") -> str:
    """CPU flags, build flags and sources in one hash, for the build's cache name:
    -march=native makes a build valid only on CPUs with the same features, and an edited
    source must not find an older build of itself under the same name.
    The checkout's path too: torch's build file names the sources by path, so two
    checkouts sharing a name would each rebuild it for the other."""
    digest = hashlib.sha1(cpu_signature() + " ".join(_BUILD_FLAGS[build]).encode())
    digest.update(str(Path(__file__).resolve().parent).encode())
    for name in SOURCES:
        digest.update(Path(__file__).with_name(name).read_bytes())
    return digest.hexdigest()[:10]


def _build(build: Build) -> ModuleType | None:
    # The native build keeps its old cache name, which scripts/setup.sh builds ahead.
    suffix = "" if build == "native" else f"{build}_"
    try:
        return build_extension(
            f"shoal_cpu_kernels_{suffix}{_build_signature(build)}",
            [str(Path(__file__).with_name("kernels.cpp"))],
            ["-O3", "-march=native", "-fopenmp", *_BUILD_FLAGS[build]],
            ["-fopenmp"],
        )
    except Exception as exc:  # no compiler, no headers: the torch path still works
        logger.warning("CPU paged-attention kernels unavailable, using torch ops: %s", exc)
        return None


_builds = Builds(_BUILD_FLAGS, "SHOAL_CPU_KERNELS", _build)


def load(build: Build = "native") -> ModuleType | None:
    return _builds.load(build)
