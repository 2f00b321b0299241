"""bench/serve_capacity.py --quick: the shipped app over a stub engine on its own local Ray,
16 SSE clients; its last line is the JSON the benchmark promises, with a delivered rate
and a CPU cost for every process on the path."""

import json
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_quick_run_reports_rate_and_cost_per_process():
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serve_capacity.py"), "--quick"]
        + ["--port", str(free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    first = result["steps"][0]
    assert first["offered_tok_s"] == 16 * 40
    assert first["errors"] == 0 and first["gap_p99_ms"] is not None
    assert first["tok_s"] > 0.5 * first["offered_tok_s"]  # it streams, even on a busy machine
    assert result["tok_s_one_ingress"] >= 0 and result["tok_s_max"] == max(
        s["tok_s"] for s in result["steps"]
    )
    us = result["cpu_us_per_token"]
    assert {"proxy", "ingress", "model", "tokenizer", "ray_other", "loadgen"} <= set(us)
    assert us["ingress"] > 0 and us["model"] > 0 and us["loadgen"] > 0
    assert us["total"] >= us["ingress"] + us["model"]
    assert result["ingress_replicas_for_10k"] >= 1
