"""Compiling Shoal's C++ kernels with torch's extension builder, safely across processes.

torch serialises concurrent builds of one extension with a lock *file* in its build
directory. A builder that dies mid-compile (a replica killed by Ray, a test's timeout, a
session ending) leaves that file behind, and every later process then waits for it
forever: a replica that never starts, with nothing in its log. Here each build first takes
an flock on a file of its own, which the kernel releases when its holder dies; every
builder takes it, so a torch lock file still present once it is held is a dead builder's.

    module = build_extension("shoal_cpu_kernels_0123abcd", [source], ["-O3"], ["-fopenmp"])

scripts/setup.sh builds the kernels once, so that replicas and tests find them compiled.

An extension links the libstdc++ this process runs on by its path. Where the compiler has
no shared libstdc++ to link (the GPU host's image has only the archive), g++ copies the
library into the extension instead; the two copies then number locale facets apart, and
the first error message that formats a number calls the wrong facet and crashes.
"""

import fcntl
import os
import shutil
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType


def cpu_signature() -> bytes:
    """The CPU's feature flags: a -march=native build runs only on CPUs that have them, so
    they belong in a build's cache name."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "").encode()
    except OSError:
        return b""


def running_libstdcxx() -> list[str]:
    """The path of the libstdc++ mapped into this process (torch's), as a linker argument;
    none where it cannot be read."""
    try:
        with open("/proc/self/maps") as f:
            rows = (line.rstrip("\n").split(maxsplit=5) for line in f)
            paths = (row[5] for row in rows if len(row) == 6)  # the path may hold spaces
            return [next(path for path in paths if "/libstdc++.so" in path)]
    except (OSError, StopIteration):
        return []


def build_directory(name: str) -> Path:
    """Where `name` is built and cached: under TORCH_EXTENSIONS_DIR when set, else torch's
    default root (~/.cache/torch_extensions)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name


def build_extension(
    name: str, sources: list[str], extra_cflags: list[str], extra_ldflags: list[str]
) -> ModuleType:
    """Compile (or load the cached build of) a C++ extension; raises when it cannot."""
    from torch.utils.cpp_extension import load

    # torch runs `ninja` from PATH; the one pip installed sits next to our python.
    if shutil.which("ninja") is None:
        os.environ["PATH"] = (
            os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        )
    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel if this process dies
        (directory / "lock").unlink(missing_ok=True)  # a dead builder's (see above)
        return load(
            name=name,
            sources=sources,
            extra_cflags=extra_cflags,
            extra_ldflags=extra_ldflags + running_libstdcxx(),
            build_directory=str(directory),
            verbose=False,
        )


class Builds:
    """The builds of one extension (native, avx2, ...), each compiled at most once per
    process: `compile(build)` returns the module or None (no compiler, a failed build),
    and `disabled_by`=0 in the environment makes every build None."""

    def __init__(
        self,
        names: Iterable[str],
        disabled_by: str,
        compile: Callable[[str], ModuleType | None],  # noqa: A002 (what it does)
    ) -> None:
        self.names = sorted(names)
        self.disabled_by = disabled_by
        self.compile = compile
        self._lock = threading.Lock()
        self._modules: dict[str, ModuleType | None] = {}

    def load(self, build: str) -> ModuleType | None:
        if build not in self.names:
            raise ValueError(f"no build {build!r}: one of {self.names}")
        with self._lock:
            if build not in self._modules:
                enabled = os.environ.get(self.disabled_by, "1") != "0"
                self._modules[build] = self.compile(build) if enabled else None
            return self._modules[build]
