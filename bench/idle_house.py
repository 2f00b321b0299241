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

The last line printed is a JSON object:
{"processes", "pss_gib", "libtorch_processes", "idle_cpu_pct_of_core", ...}.

    cd <repo root> && .venv/bin/python bench/idle_house.py
"""

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

URL = "http://127.0.0.1:8000"
RAY_DAEMONS = ("raylet", "gcs_server")
METHOD = re.compile(r"\.[a-z_][a-z0-9_]*$")
SESSION = re.compile(r"session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_\d+")


def ray_daemons(exclude: set[int] = frozenset()) -> list[psutil.Process]:
    """Ray's raylets and GCS servers running on this machine (not in `exclude`)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            name = proc.info["name"] or ""
            argv0 = (proc.info["cmdline"] or [""])[0]
            if proc.pid not in exclude and (
                name in RAY_DAEMONS or any(argv0.endswith("/" + d) for d in RAY_DAEMONS)
            ):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def port_taken(port: int) -> bool:
    try:
        return any(
            c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
            for c in psutil.net_connections("tcp")
        )
    except psutil.Error:
        return False


def title(proc: psutil.Process) -> str:
    """A process's title: Ray workers set theirs (ray::ServeReplica:default:Ingress)."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return "?"
    if not cmd:
        return proc.name()
    first = cmd[0]
    if first.startswith("ray::"):
        # The title ends with the method running, if any (ray::ServeController.listen_for_change)
        return METHOD.sub("", first.split(" ")[0])
    words = [Path(cmd[0]).name, *cmd[1:]]
    if Path(cmd[0]).name.startswith("python") and len(cmd) > 1:
        words = words[1:]
        if words[0] == "-c" and len(words) > 1:
            words = ["-c", words[1][:40]]
        elif words[0] == "-m" and len(words) > 1:
            words = ["-m", words[1]]
        else:
            words[0] = Path(words[0]).name if "/" in words[0] else words[0]
    return " ".join(words)[:70]


def app_processes(root: psutil.Process, session: str | None) -> dict[int, psutil.Process]:
    """`root`'s process tree and every process of the Ray session `session`."""
    procs = {root.pid: root}
    with contextlib.suppress(psutil.Error):
        procs.update({p.pid: p for p in root.children(recursive=True)})
    if session:
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if proc.pid not in procs and session in " ".join(proc.info["cmdline"] or []):
                    procs[proc.pid] = proc
                    procs.update({p.pid: p for p in proc.children(recursive=True)})
            except psutil.Error:
                continue
    return procs


def session_of(procs: dict[int, psutil.Process]) -> str | None:
    for proc in procs.values():
        try:
            match = SESSION.search(" ".join(proc.cmdline()))
        except psutil.Error:
            continue
        if match:
            return match.group(0)
    return None


def maps_libtorch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch_cpu.so" in f.read()
    except OSError:
        return False


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def label(proc: psutil.Process, procs: dict[int, psutil.Process]) -> str:
    """The title, and for a child of a Ray worker (the engine process) its parent's."""
    name = title(proc)
    try:
        parent = proc.ppid()
    except psutil.Error:
        return name
    if not name.startswith("ray::") and parent in procs:
        parent_title = title(procs[parent])
        if parent_title.startswith("ray::"):
            return f"{name} (child of {parent_title})"
    return name


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


def measure(root: psutil.Process, window_s: float) -> dict:
    session = session_of(app_processes(root, None))
    before = app_processes(root, session)
    start_cpu: dict[int, tuple[float, float]] = {}
    for pid, proc in before.items():
        try:
            start_cpu[pid] = (proc.create_time(), cpu_seconds(proc))
        except psutil.Error:
            continue
    time.sleep(window_s)
    after = app_processes(root, session)
    rows = []
    total_cpu = 0.0
    for pid, proc in after.items():
        try:
            created, cpu = proc.create_time(), cpu_seconds(proc)
            pss = proc.memory_full_info().pss
        except psutil.Error:
            continue
        was = start_cpu.get(pid)
        spent = cpu - was[1] if was and was[0] == created else cpu  # new during the window
        total_cpu += spent
        rows.append(
            {
                "pid": pid,
                "name": label(proc, after),
                "pss_mib": pss / 2**20,
                "cpu_s": spent,
                "libtorch": maps_libtorch(pid),
            }
        )
    gone = sorted(set(start_cpu) - set(after))
    rows.sort(key=lambda r: -r["pss_mib"])
    return {"session": session, "rows": rows, "cpu_s": total_cpu, "gone": gone}


def stop(server: subprocess.Popen, ours: dict[int, psutil.Process]) -> None:
    """SIGINT (Ctrl-C), SIGTERM, then `ray stop --force` or our leftover pids."""
    for sig, wait_s in ((signal.SIGINT, 60), (signal.SIGTERM, 20)):
        if server.poll() is None:
            server.send_signal(sig)
            try:
                server.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
    if server.poll() is None:
        server.kill()
        server.wait()
    deadline = time.monotonic() + 15
    left = []
    while time.monotonic() < deadline:
        left = [p for p in ours.values() if p.pid != server.pid and p.is_running()]
        if not left:
            return
        time.sleep(1)
    others = ray_daemons(exclude=set(ours))
    if others:
        print(
            f"another Ray started meanwhile ({[p.pid for p in others]}): not running "
            f"`ray stop`; ending this app's {len(left)} leftover processes by pid"
        )
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        return
    print(f"{len(left)} processes of the Ray this bench started remain: ray stop --force")
    ray = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray), "stop", "--force"], check=False, timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle", type=float, default=20.0, help="seconds after warm-up")
    parser.add_argument("--window", type=float, default=60.0, help="idle seconds measured")
    parser.add_argument("--timeout", type=float, default=1200.0, help="start-up limit, s")
    parser.add_argument("--model", default="smollm2-135m-instruct")
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

    serve = Path(sys.executable).with_name("serve")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Ray's workers import the app from this directory (not an editable install's).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root_dir), env.get("PYTHONPATH")]))
    log = Path(tempfile.mkstemp(prefix="idle_house-", suffix=".log")[1])
    print(f"serve run app:graph in {root_dir} (log: {log})", flush=True)
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [str(serve), "run", "app:graph"],
            cwd=root_dir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    root = psutil.Process(server.pid)
    ours: dict[int, psutil.Process] = {}
    try:
        ready_s = wait_ready(server, args.model, args.timeout, log)
        print(f"healthy and warm after {ready_s:.0f} s; settling {args.settle:.0f} s", flush=True)
        time.sleep(args.settle)
        ours = app_processes(root, session_of(app_processes(root, None)))
        print(f"measuring {args.window:.0f} s of idle", flush=True)
        result = measure(root, args.window)
        ours.update(app_processes(root, result["session"]))
    finally:
        ours.update(app_processes(root, session_of(ours) if ours else None))
        stop(server, ours)

    rows = result["rows"]
    print(f"\n{'pid':>7} {'PSS MiB':>8} {'CPU s':>7} {'%core':>6} torch  process")
    for r in rows:
        pct = 100 * r["cpu_s"] / args.window
        torch = "yes" if r["libtorch"] else ""
        print(
            f"{r['pid']:>7} {r['pss_mib']:>8.1f} {r['cpu_s']:>7.2f} {pct:>6.2f} {torch:<5}  {r['name']}"
        )
    if result["gone"]:
        print(f"(exited during the window, not counted: {result['gone']})")
    busiest = sorted(rows, key=lambda r: -r["cpu_s"])[:8]
    summary = {
        "processes": len(rows),
        "pss_gib": round(sum(r["pss_mib"] for r in rows) / 1024, 2),
        "libtorch_processes": sorted(r["name"] for r in rows if r["libtorch"]),
        "idle_cpu_pct_of_core": round(100 * result["cpu_s"] / args.window, 2),
        "idle_cpu_s": round(result["cpu_s"], 2),
        "window_s": args.window,
        "busiest": {
            f"{r['name']} [{r['pid']}]": round(100 * r["cpu_s"] / args.window, 2) for r in busiest
        },
        "repo": str(root_dir),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
