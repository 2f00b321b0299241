"""A kernel build left half-done by a dead process does not stop the next one.

torch's own lock file outlives a builder that is killed mid-compile; before
app.models.kernel_build, every later replica then waited on it forever (CI: a test's
cluster was torn down while its replica compiled, and the next suites' replicas never
started).
"""

import subprocess
import sys

from app.models import cpu_kernels
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
