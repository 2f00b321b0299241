"""`serve run app:graph` stopped with SIGTERM (docker stop, systemd) drains as on Ctrl-C:
an open stream ends properly, the process exits 0, and Ray's fatal-signal handler (a
stack dump, then death by signal) never runs (deployments/serve_cli.py).

The command runs as a user runs it, against a Ray cluster of this test's own (its
Serve listening on a free port: `serve run app:graph` itself always takes 8000, which
the session's live app holds), and the cluster is stopped whatever happens."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.local_cluster import LocalCluster, free_port
from tests.serve.live import wait_healthy

MODEL = "smollm2-135m-instruct"


def test_sigterm_drains_open_streams_and_exits_0(tmp_path: Path):
    config = tmp_path / "shoal.yaml"
    config.write_text(json.dumps({"embeddings": {"enabled": False}, "models": [{}]}))
    serve_cli = str(Path(sys.executable).with_name("serve"))
    cluster = LocalCluster()
    proc = None
    try:
        address = cluster.start_head(num_cpus=8)
        port = free_port()
        env = {**os.environ, "SHOAL_CONFIG": str(config), "RAY_ADDRESS": address}
        subprocess.run(
            [serve_cli, "start", "--http-host=127.0.0.1", f"--http-port={port}"],
            env=env,
            check=True,
            capture_output=True,
            timeout=180,
        )
        proc = subprocess.Popen(
            [serve_cli, "run", "app:graph"],
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300}
        body |= {"ignore_eos": True, "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            events += [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks)
        _, stderr = proc.communicate(timeout=240)  # past serve_cli.DRAIN_LIMIT_S
        assert proc.returncode == 0, stderr[-3000:]
        assert "SIGTERM received" not in stderr and "*** " not in stderr, stderr[-3000:]
        assert time.monotonic() - started < 120
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        cluster.stop()
