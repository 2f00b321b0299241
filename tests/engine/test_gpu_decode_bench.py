"""bench/gpu_decode.py runs on any machine (its small CPU configuration here), and the
engine it drives needs no Ray: the GPU test machine has none."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_engine_imports_and_runs_without_ray():
    code = (
        "import sys, app.engine, app.models.loader\n"
        "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


@pytest.mark.live  # the benchmark and its engine run in a process of their own
def test_gpu_decode_bench_runs_on_cpu():
    out = subprocess.run(
        [
            sys.executable,
            "bench/gpu_decode.py",
            "--device=cpu",
            "--concurrency=1,2",
            "--ttft=32",
            "--kv-gib=0.05",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    (result,) = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["shape"] == "tiny" and result["device"] == "cpu"
    assert result["floor_ms"] > 0 and result["shoal"]["decode_ms"] > 0
    assert set(result["shoal"]["tok_s"]) == set(result["transformers"]["tok_s"]) == {"1", "2"}
    assert all(v > 0 for v in result["tok_s_ratio"].values())
    assert result["shoal"]["ttft_ms"]["32"] > 0
