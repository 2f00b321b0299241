"""OpenMP's worker threads stay with the thread that steps the engine (app.engine.openmp_threads).

A second pool of spinning workers (the loading thread's, a helper thread's) made every
decode step's parallel regions sleep and wake instead of spin: 2x slower on 2 cores.
The checks count a fresh process's threads (a test process has others coming and going),
which is what the runtime counts too.
"""

import json
import subprocess
import sys
import textwrap

PRELUDE = """
import json, os, threading
from concurrent.futures import ThreadPoolExecutor
import torch
from app.engine.openmp_threads import release_pool, run_then_release
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
def parallel_op():
    torch.mm(torch.randn(256, 512), torch.randn(512, 512))
counts = {}
"""


def run(script: str) -> dict:
    code = PRELUDE + textwrap.dedent(script) + "\nprint(json.dumps(counts))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return json.loads(done.stdout.decode().splitlines()[-1])


def test_release_pool_ends_this_threads_workers():
    counts = run(
        """
        counts["before"] = threads()
        parallel_op()
        counts["with pool"] = threads()
        counts["released"] = release_pool()
        counts["after"] = threads()
        """
    )
    assert counts["released"], "torch's OpenMP runtime has no omp_pause_resource_all"
    assert counts["with pool"] > counts["before"]  # the region started a worker
    assert counts["after"] == counts["before"]


def test_a_helpers_jobs_leave_no_workers():
    counts = run(
        """
        with ThreadPoolExecutor(1) as helper:
            helper.submit(lambda: None).result()  # the helper thread exists now
            counts["before"] = threads()
            helper.submit(run_then_release, parallel_op).result()
            counts["after"] = threads()
        counts["caller"] = torch.get_num_threads()
        """
    )
    assert counts["after"] == counts["before"]
    assert counts["caller"] == 2  # the process's thread count is untouched
