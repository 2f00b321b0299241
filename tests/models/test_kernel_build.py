"""A kernel build left half-done by a dead process does not stop the next one.

torch's own lock file outlives a builder that is killed mid-compile; before
app.models.kernel_build, every later replica then waited on it forever (CI: a test's
cluster was torn down while its replica compiled, and the next suites' replicas never
started).
"""

import fnmatch
import subprocess
import sys
import tomllib
from pathlib import Path

from app.models import cpu_kernels, quant
from app.models.kernel_build import build_directory

LOAD = "from app.models import cpu_kernels; assert cpu_kernels.load() is not None"


def test_a_dead_builders_lock_file_is_cleared():
    assert cpu_kernels.load() is not None, "C++ kernels failed to build"
    directory = build_directory(f"shoal_cpu_kernels_{cpu_kernels._build_signature()}")
    stale = directory / "lock"
    stale.touch()  # as a builder killed between torch's try_acquire and release leaves it

    # A fresh process, as a replica would be: before, it slept on the file for good.
    done = subprocess.run([sys.executable, "-c", LOAD], timeout=300, capture_output=True)

    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert not stale.exists()


def test_every_kernel_source_is_package_data():
    """`pip install .` (the k8s image) ships the sources the kernels compile from: a
    missing header fails both builds, and quantized models fall back to float."""
    globs = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["tool"][
        "setuptools"
    ]["package-data"]
    root = Path(cpu_kernels.__file__).parent.parent
    sources = [root / "cpu_kernels" / name for name in cpu_kernels.SOURCES]
    sources += [(root / "quant" / name).resolve() for name in quant._SOURCES]
    for path in sources:
        assert path.exists(), path
        package = "app.models." + path.parent.name
        assert any(fnmatch.fnmatch(path.name, g) for g in globs[package]), (path, package)


def test_the_kernels_share_the_processs_libstdcxx():
    """Each extension names libstdc++ as a shared library rather than carrying a copy: on
    the GPU host, whose g++ had only the archive, a copied libstdc++ crashed the first
    error message that formatted a number (its locale facets numbered apart). Only a host
    like that one can fail it."""
    for module in (cpu_kernels.load(), quant.load()):
        assert module is not None, "C++ kernels failed to build"
        dynamic = subprocess.run(
            ["readelf", "--dynamic", module.__file__], capture_output=True, text=True, check=True
        ).stdout
        assert "[libstdc++.so.6]" in dynamic, module.__file__
