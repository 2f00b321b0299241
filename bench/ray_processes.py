"""The processes of an app that `serve run` started: its process tree and its Ray
session's processes, their titles, PSS, CPU and whether they map libtorch; and how to
stop it all. Used by bench/idle_house.py."""

import contextlib
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

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
