"""bench/step_overhead.py runs (a small configuration), and its last line carries the
figures the issue asks for."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.live  # the benchmark and its engine run in a process of their own
def test_step_overhead_bench_runs():
    out = subprocess.run(
        [sys.executable, "bench/step_overhead.py", "--seqs=1,4", "--steps=10", "--temperature=0.7"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for n in (1, 4):
        assert result[f"ms_per_step_{n}"] > 0
        split = [result[f"{phase}_ms_{n}"] for phase in ("schedule", "prepare", "sample")]
        assert all(v > 0 for v in split)
        assert sum(split) < result[f"ms_per_step_{n}"] * 2  # a split of the step, not more
