"""bench/soak.py, its CI length: three minutes of mixed load over every dialect through
`serve run` of app:graph on a Ray of its own, the model replica killed once (at 90 s)
and replaced by Serve; no 5xx and no errored stream outside the kill's window, nothing
left on the replica (contexts, KV blocks, requests), every dialect answered 2xx."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_three_minute_soak_with_a_replica_killed():
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "3"]
        + ["--kill-every-s", "90", "--warmup-s", "20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    summary = json.dumps({k: v for k, v in result.items() if k not in ("rss", "warmup")})
    assert len(result["kills"]) == 1 and result["kills"][0]["replaced_after_s"] is not None
    assert result["server_errors_outside_kills"] == 0, summary
    assert result["client_errors_outside_kills"] == 0, summary
    assert result["stream_errors_outside_kills"] == 0, summary
    assert result["unanswered_outside_kills"] == 0, summary
    assert result["dialects_without_2xx"] == [], summary
    assert result["contexts_leaked"] == 0 and result["kv_blocks_leaked"] == 0, summary
    assert result["requests_left_running"] == 0, summary
    # The RSS of every role the target covers was read at both ends.
    assert {"ingress", "tokenizer", "model_replica", "model_engine", "embedder", "operator"} <= {
        r for r, row in result["rss"].items() if row.get("growth_pct") is not None
    }, result["rss"]
