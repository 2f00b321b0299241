"""The app under the soak (bench/soak.py): `serve run` of app:graph on its own local Ray,
this process connected to that Ray as a driver (by its GCS address, never `auto`: other
Rays may run on the machine), a model replica killed and its replacement awaited, the
replica's own figures, and each process's RSS by role."""

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.ray_processes import app_processes, label, session_of, stop  # noqa: E402

APP = "default"
# The processes the RSS target covers, by what their label (bench/ray_processes.py) holds;
# the first match wins (the engine process is a child of the ModelServer replica).
ROLES = [
    ("model_engine", "(child of ray::ServeReplica:default:ModelServer"),
    ("model_replica", "ServeReplica:default:ModelServer"),
    ("ingress", "ServeReplica:default:Ingress"),
    ("tokenizer", "ServeReplica:default:Tokenizer"),
    ("embedder", "ServeReplica:default:Embedder"),
    ("operator", "ServeReplica:default:Operator"),
    ("registry", "ServeReplica:default:EngineRegistry"),
    ("serve_controller", "ray::ServeController"),
    ("serve_proxy", "ray::ProxyActor"),
    ("gcs_server", "gcs_server"),
    ("raylet", "raylet"),
]


def serve_config(port: int) -> str:
    """A Serve config that runs app:graph with its defaults on 127.0.0.1:`port` (`serve
    run app:graph` itself has no port option)."""
    return (
        f"http_options:\n  host: 127.0.0.1\n  port: {port}\n"
        f"applications:\n  - name: {APP}\n    route_prefix: /\n    import_path: app:graph\n"
    )


class App:
    """`serve run` of the app, started in the repo root `root`; `stop()` ends it all."""

    def __init__(self, root: Path, port: int, model: str) -> None:
        self.url, self.model = f"http://127.0.0.1:{port}", model
        self.state = tempfile.TemporaryDirectory(prefix="shoal-soak-")
        config = Path(self.state.name) / "serve.yaml"
        config.write_text(serve_config(port))
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        # The Assistants database and the operator's downloads: never the user's own.
        env.setdefault("SHOAL_ASSISTANTS_DB", str(Path(self.state.name) / "assistants.sqlite3"))
        env.setdefault("SHOAL_MODELS_DIR", str(Path(self.state.name) / "models"))
        self.log = Path(tempfile.mkstemp(prefix="shoal-soak-", suffix=".log")[1])  # kept
        serve = Path(sys.executable).with_name("serve")
        with open(self.log, "wb") as out:
            self.server = subprocess.Popen(
                [str(serve), "run", str(config)],
                cwd=root,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.root = psutil.Process(self.server.pid)
        self.ours: dict[int, psutil.Process] = {}
        self.exit_code: int | None = None

    def wait_healthy(self, timeout_s: float) -> float:
        start = time.monotonic()
        while time.monotonic() < start + timeout_s:
            if self.server.poll() is not None:
                raise SystemExit(f"serve run exited ({self.server.returncode}); see {self.log}")
            # `serve run` of a config file stays up when the app fails to build.
            if f"Deploying app '{APP}' failed" in self.log.read_text(errors="replace"):
                raise SystemExit(f"the app failed to deploy; see {self.log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - start
            time.sleep(2)
        raise SystemExit(f"not healthy after {timeout_s:.0f} s; see {self.log}")

    def processes(self) -> dict[int, psutil.Process]:
        procs = app_processes(self.root, session_of(app_processes(self.root, None)))
        self.ours.update(procs)
        return procs

    def connect(self) -> None:
        """This process joins the app's Ray as a driver, by its raylet's GCS address, in
        the raylet's authentication mode (a local Ray started with a token on disk uses
        it; a driver joining it must say so before Ray is imported)."""
        for proc in self.processes().values():
            with contextlib.suppress(psutil.Error):
                for arg in proc.cmdline():
                    if arg.startswith("--gcs-address="):
                        mode = proc.environ().get("RAY_AUTH_MODE")
                        if mode and "RAY_AUTH_MODE" not in os.environ:
                            os.environ["RAY_AUTH_MODE"] = mode
                        import ray

                        ray.init(address=arg.split("=", 1)[1], log_to_driver=False)
                        return
        raise SystemExit(f"no raylet of this app's Ray found; see {self.log}")

    def replica_names(self) -> list[str]:
        import ray

        prefix = f"SERVE_REPLICA::{APP}#ModelServer:{self.model}#"
        named = ray.util.list_named_actors(all_namespaces=True)
        return [
            a["name"] for a in named if a["namespace"] == "serve" and a["name"].startswith(prefix)
        ]

    def kill_replica(self) -> str:
        """ray.kill of one ModelServer replica actor (Serve must replace it): its name."""
        import ray

        victim = self.replica_names()[0]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        return victim

    def wait_replaced(self, victim: str, timeout_s: float) -> float:
        """Seconds until another replica than `victim` runs and Serve calls the model's
        deployment healthy."""
        from ray import serve

        start = time.monotonic()
        while time.monotonic() < start + timeout_s:
            names = self.replica_names()
            if names and victim not in names:
                with contextlib.suppress(Exception):
                    d = serve.status().applications[APP].deployments[f"ModelServer:{self.model}"]
                    running = d.replica_states.get("RUNNING", 0)
                    if running >= 1 and d.status == "HEALTHY":
                        return time.monotonic() - start
            time.sleep(0.25)
        raise TimeoutError(f"{victim} not replaced after {timeout_s:.0f} s")

    def replica_stats(self) -> dict:
        """The live replica's engine figures (contexts, KV blocks, queues)."""
        from ray import serve

        handle = serve.get_deployment_handle(f"ModelServer:{self.model}", app_name=APP)
        return handle.stats.remote().result(timeout_s=60)

    def rss(self) -> dict[str, dict]:
        """RSS by role (MiB, summed over its processes, and its pids); other processes of
        the app by label."""
        procs = self.processes()
        found: dict[str, dict] = {}
        for pid, proc in procs.items():
            try:
                name, rss = label(proc, procs), proc.memory_info().rss
            except psutil.Error:
                continue
            if pid == self.server.pid:
                role = "serve_run"
            else:
                role = next((r for r, key in ROLES if key in name), f"other: {name}")
            entry = found.setdefault(role, {"rss_mib": 0.0, "pids": []})
            entry["rss_mib"] += rss / 2**20
            entry["pids"].append(pid)
        return found

    def stop(self) -> None:
        """SIGTERM to `serve run` (what docker and systemd send), then the house's stop
        (SIGINT, SIGTERM, leftovers by pid or `ray stop`) for whatever remains."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        with contextlib.suppress(psutil.Error, SystemExit):
            self.processes()
        if self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.wait(90)
        self.exit_code = self.server.poll()
        stop(self.server, self.ours)
        self.state.cleanup()
