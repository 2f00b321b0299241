"""A short bounded locust run (8 users, about 20 s) against the real app: no failures."""

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_locust_run_has_no_failures(base_url, tmp_path):
    run = subprocess.run(
        [
            sys.executable, "-m", "locust",
            "-f", str(ROOT / "loadtests" / "locustfile.py"),
            "--headless", "-u", "8", "-r", "8", "-t", "20s",
            "--stop-timeout", "60",
            "--host", base_url,
            "--csv", str(tmp_path / "run"),
            "--only-summary",
        ],
        env={**os.environ, "SHOAL_MAX_TOKENS": "8,32,64"},
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / "run_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    total = rows[("", "Aggregated")]
    assert int(total["Failure Count"]) == 0
    for name in ("chat", "completions", "ollama chat"):
        assert int(rows[("TTFT", name)]["Request Count"]) > 0, name
    assert int(rows[("POST", "chat")]["Request Count"]) >= 4
    assert float(rows[("tok/s", "chat")]["Average Response Time"]) > 0
