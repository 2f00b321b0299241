"""Idle house: what the default app costs when nobody asks it anything.

Starts the app the way users do (`serve run app:graph`, the venv's `serve`, in the
current directory: run it from the repo root whose code you want to measure), waits
until GET /health answers 200 and a warm-up chat completion is answered, lets it settle
(`--settle`, 20 s), then watches `--window` seconds (60) of idle and reports:

- processes: the process tree of `serve run` (Ray's gcs_server, raylet, dashboard and
  the rest, the workers, the replicas, the engine process) and any other process of the
  same Ray session (its cmdline names the session);
- PSS: the sum of every such process's proportional set size (shared pages split
  between the processes that map them, so the sum is what the app costs the machine);
- which of them map libtorch (libtorch_cpu.so in /proc/PID/maps), by name (Ray workers'
  process titles, e.g. ray::ServeReplica:default:Ingress);
- idle CPU: the CPU seconds (user + system) all of them spent over the window, as a % of
  one core, with each process's share (Serve's controller and proxy are counted, and
  shown, like everything else).

It refuses to start when another Ray is running on this machine (its processes would be
hard to tell from the app's, and `ray stop` would stop it) or port 8000 is taken. It
stops what it started: SIGINT to `serve run` (Ctrl-C: Serve shuts the app down), then
SIGTERM, then `ray stop --force` only if processes of the Ray it started remain and no
other Ray has appeared meanwhile (else those processes alone, by pid).

Then the peer, measured the same way in the same run: Ray Serve's own floor, a
one-deployment app that answers "hello" (`serve run hello:app`, Ray's defaults), so the
app's idle cost reads against what any Ray Serve app costs on this machine (`--no-peer`
skips it).

The last line printed is a JSON object: {"processes", "pss_gib", "libtorch_processes",
"idle_cpu_pct_of_core", "serve_hello_idle_cpu_pct_of_core", "idle_ratio_vs_serve_hello",
...}.

    cd <repo root> && .venv/bin/python bench/idle_house.py
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.ray_processes import (  # noqa: E402
    app_processes,
    measure,
    port_taken,
    ray_daemons,
    session_of,
    stop,
)

URL = "http://127.0.0.1:8000"
HELLO = """from ray import serve


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Hello:
    def __call__(self, request):
        return "hello"


app = Hello.bind()
"""


def wait_ready(server: subprocess.Popen, model: str, timeout_s: float, log: Path) -> float:
    """Seconds until /health answers 200 and a chat completion is answered."""
    start = time.monotonic()
    deadline = start + timeout_s
    with httpx.Client(timeout=10) as client:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"serve run exited ({server.returncode}); see {log}")
            if time.monotonic() > deadline:
                raise SystemExit(f"not healthy after {timeout_s:.0f} s; see {log}")
            try:
                if client.get(f"{URL}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "temperature": 0,
        }
        while True:
            try:
                response = client.post(f"{URL}/v1/chat/completions", json=body, timeout=120)
                if response.status_code == 200:
                    response.json()["choices"][0]["message"]
                    return time.monotonic() - start
                print(f"warm-up: {response.status_code} {response.text[:200]}", flush=True)
            except httpx.HTTPError as exc:
                print(f"warm-up: {exc!r}", flush=True)
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"the warm-up chat completion was not answered; see {log}")
            time.sleep(3)


def hello_ready(server: subprocess.Popen, timeout_s: float, log: Path) -> float:
    start = time.monotonic()
    while time.monotonic() < start + timeout_s and server.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(URL, timeout=5).text == "hello":
                return time.monotonic() - start
        time.sleep(1)
    raise SystemExit(f"the hello app did not answer; see {log}")


def run_idle(target: str, cwd: Path, ready: Callable[..., float], args: argparse.Namespace) -> dict:
    """`serve run <target>` in `cwd`: started, made ready, settled, measured, stopped."""
    serve = Path(sys.executable).with_name("serve")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Ray's workers import the app from this directory (not an editable install's).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(cwd), env.get("PYTHONPATH")]))
    log = Path(tempfile.mkstemp(prefix="idle_house-", suffix=".log")[1])
    print(f"serve run {target} in {cwd} (log: {log})", flush=True)
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [str(serve), "run", target],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    root = psutil.Process(server.pid)
    ours: dict[int, psutil.Process] = {}
    try:
        ready_s = ready(server, args.timeout, log)
        print(f"ready after {ready_s:.0f} s; settling {args.settle:.0f} s", flush=True)
        time.sleep(args.settle)
        ours = app_processes(root, session_of(app_processes(root, None)))
        print(f"measuring {args.window:.0f} s of idle", flush=True)
        result = measure(root, args.window)
        ours.update(app_processes(root, result["session"]))
    finally:
        ours.update(app_processes(root, session_of(ours) if ours else None))
        stop(server, ours)
    return result


def report(result: dict, window_s: float) -> dict:
    rows = result["rows"]
    print(f"\n{'pid':>7} {'PSS MiB':>8} {'CPU s':>7} {'%core':>6} torch  process")
    for r in rows:
        pct = 100 * r["cpu_s"] / window_s
        torch = "yes" if r["libtorch"] else ""
        print(
            f"{r['pid']:>7} {r['pss_mib']:>8.1f} {r['cpu_s']:>7.2f} {pct:>6.2f} {torch:<5}  {r['name']}"
        )
    if result["gone"]:
        print(f"(exited during the window, not counted: {result['gone']})")
    print(f"total: {100 * result['cpu_s'] / window_s:.2f} % of a core\n", flush=True)
    return {
        "processes": len(rows),
        "pss_gib": round(sum(r["pss_mib"] for r in rows) / 1024, 2),
        "idle_cpu_pct_of_core": round(100 * result["cpu_s"] / window_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle", type=float, default=20.0, help="seconds after warm-up")
    parser.add_argument("--window", type=float, default=60.0, help="idle seconds measured")
    parser.add_argument("--timeout", type=float, default=1200.0, help="start-up limit, s")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--no-peer", action="store_true", help="skip the hello app")
    args = parser.parse_args()

    root_dir = Path.cwd()
    if not (root_dir / "app").is_dir() or not (root_dir / "deployments").is_dir():
        raise SystemExit(
            f"run this from a Shoal repo root (no app/ and deployments/ in {root_dir})"
        )
    running = ray_daemons()
    if running:
        raise SystemExit(
            f"another Ray is running here (pids {[p.pid for p in running]}): refusing, "
            "its processes would be counted and `ray stop` would stop it"
        )
    if port_taken(8000):
        raise SystemExit("port 8000 is taken: refusing")

    def shoal_ready(server: subprocess.Popen, timeout_s: float, log: Path) -> float:
        return wait_ready(server, args.model, timeout_s, log)

    result = run_idle("app:graph", root_dir, shoal_ready, args)
    summary = report(result, args.window)
    rows = result["rows"]
    busiest = sorted(rows, key=lambda r: -r["cpu_s"])[:8]
    summary["libtorch_processes"] = sorted(r["name"] for r in rows if r["libtorch"])
    summary["idle_cpu_s"] = round(result["cpu_s"], 2)
    summary["window_s"] = args.window
    summary["busiest"] = {
        f"{r['name']} [{r['pid']}]": round(100 * r["cpu_s"] / args.window, 2) for r in busiest
    }
    if not args.no_peer:
        with tempfile.TemporaryDirectory(prefix="serve-hello-") as hello_dir:
            (Path(hello_dir) / "hello.py").write_text(HELLO)
            peer = report(run_idle("hello:app", Path(hello_dir), hello_ready, args), args.window)
        summary["serve_hello_processes"] = peer["processes"]
        summary["serve_hello_pss_gib"] = peer["pss_gib"]
        summary["serve_hello_idle_cpu_pct_of_core"] = peer["idle_cpu_pct_of_core"]
        summary["idle_ratio_vs_serve_hello"] = round(
            summary["idle_cpu_pct_of_core"] / max(peer["idle_cpu_pct_of_core"], 1e-9), 2
        )
    summary["repo"] = str(root_dir)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
