"""LocalCluster: a multi-node Ray cluster on one machine, started with `ray start`.

Each node is its own raylet (with its own resources), as on separate machines; the head
also runs the GCS. `kill_node` SIGKILLs a node's raylet, which takes its workers and
agents with it: what the cluster sees when a machine dies. Used by the multi-node tests
and bench/scale.py; `stop` kills every process of this cluster and nothing else.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

# Fail a silent node within ~5 s rather than Ray's default ~15 s, with room for a raylet
# that is merely slow on a busy 2-core machine.
FAST_FAILURE = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "5",
}
# `ray start` turns on token authentication by default; a throwaway local cluster does
# without (this process connects as its driver, so it must agree).
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}


def kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    def __init__(self) -> None:
        # Short: Ray's socket paths live under it and must fit in 107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="shoal-", dir="/tmp"))
        self.ray = str(Path(sys.executable).with_name("ray"))
        self.address: str | None = None
        self.nodes: dict[str, int] = {}  # name -> its raylet's node manager port
        self._saved_env = {k: os.environ.get(k) for k in NO_AUTH}
        os.environ.update(NO_AUTH)

    def start_head(
        self,
        num_cpus: float,
        resources: dict[str, float] | None = None,
        env: dict[str, str] | None = None,
    ) -> str:
        """`env`: more environment for the head's processes (flags Ray reads at start)."""
        port = free_port()
        self._start(
            "head",
            [
                "--head",
                f"--port={port}",
                f"--temp-dir={self.temp_dir}",
                "--include-dashboard=false",
                f"--ray-client-server-port={free_port()}",
            ],
            num_cpus,
            resources,
            env,
        )
        self.address = f"127.0.0.1:{port}"
        return self.address

    def add_node(self, name: str, num_cpus: float, resources: dict[str, float] | None = None):
        assert self.address, "start the head first"
        self._start(name, [f"--address={self.address}"], num_cpus, resources)

    def _start(
        self,
        name: str,
        args: list[str],
        num_cpus: float,
        resources,
        env: dict[str, str] | None = None,
    ) -> None:
        manager_port = free_port()
        command = [
            self.ray,
            "start",
            *args,
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus}",
            f"--resources={json.dumps(resources or {})}",
            f"--node-manager-port={manager_port}",
            f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            "--disable-usage-stats",
        ]
        full_env = {**os.environ, **FAST_FAILURE, **NO_AUTH, **(env or {})}
        subprocess.run(command, check=True, env=full_env, capture_output=True, timeout=120)
        self.nodes[name] = manager_port

    def raylet(self, name: str) -> psutil.Process:
        flag = f"--node_manager_port={self.nodes[name]}"
        for p in psutil.process_iter(["name", "cmdline"]):
            if "raylet" in (p.info["name"] or "") and flag in (p.info["cmdline"] or []):
                return p
        raise LookupError(f"no raylet for node {name}")

    def kill_node(self, name: str) -> None:
        """SIGKILL the node's raylet and everything it started (its workers)."""
        raylet = self.raylet(name)
        kill([raylet, *raylet.children(recursive=True)])
        del self.nodes[name]

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster: each names the temp dir or a raylet's port."""
        marks = [str(self.temp_dir), *(f"--node_manager_port={p}" for p in self.nodes.values())]
        found = []
        for p in psutil.process_iter(["cmdline"]):
            line = " ".join(p.info["cmdline"] or [])
            if p.pid != os.getpid() and any(m in line for m in marks):
                found.append(p)
        return found

    def stop(self) -> None:
        procs = self.processes()
        for p in list(procs):
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.extend(p.children(recursive=True))
        kill(procs)
        self.nodes.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def wait_for(self, predicate, timeout_s: float, what: str, every_s: float = 0.5):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(every_s)
        raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


def running(deployment: str, app: str = "default") -> int:
    """Running replicas of a Serve deployment, as the controller reports them."""
    from ray import serve

    status = serve.status().applications.get(app)
    d = status.deployments.get(deployment) if status else None
    return d.replica_states.get("RUNNING", 0) if d else 0


@contextmanager
def head_and_worker_app(application, model_deployment: str) -> Iterator[tuple[LocalCluster, str]]:
    """`application` (two 1-CPU model replicas) as app "default" on a 2-CPU head and a
    1-CPU worker node with a `worker` resource; yields (cluster, URL) once both replicas
    run and /health answers, and stops Serve, Ray and the cluster after.

    The head has room for the light deployments and one model replica. The worker joins
    only once those are placed, so that its CPU is left for the second replica."""
    import ray
    from ray import serve

    c = LocalCluster()
    try:
        c.start_head(num_cpus=2)
        ray.init(address=c.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        # serve.run returns once every replica runs, which needs the worker: deploy from a
        # thread while the worker joins.
        deploying = threading.Thread(
            target=serve.run, args=(application,), kwargs={"name": "default"}
        )
        deploying.start()
        head = ("Ingress", "Tokenizer", "EngineRegistry", model_deployment)
        c.wait_for(lambda: all(map(running, head)), 300, "the head's share of the app")
        c.add_node("worker", num_cpus=1, resources={"worker": 1})
        deploying.join(timeout=300)
        url = f"http://127.0.0.1:{port}"
        c.wait_for(lambda: running(model_deployment) == 2, 300, "two running model replicas")
        c.wait_for(lambda: healthy(url), 60, "the app's /health")
        yield c, url
    finally:
        try:
            serve.shutdown()
            ray.shutdown()
        finally:
            c.stop()


def healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
