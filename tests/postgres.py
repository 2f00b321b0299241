"""A real PostgreSQL server for a test: Debian's `postgresql` binaries, a fresh cluster in
a temporary directory on a free loopback port, stopped and removed afterwards.

`.ci/run` installs the package where it is missing; elsewhere a test that needs the
server is skipped with the reason (the binaries are not there and cannot be installed).
"""

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


def _runuser() -> str | None:
    """runuser, also where a minimal PATH (no sbin directories) does not reach it."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return shutil.which("runuser", path=path)


def unavailable() -> str | None:
    """Why no server can be started here, or None."""
    if _bin("initdb") is None or _bin("pg_ctl") is None:
        return "PostgreSQL's server binaries (Debian package postgresql) are not installed"
    if os.geteuid() == 0 and _runuser() is None:
        return "running as root without runuser: initdb refuses root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Yields a SQLAlchemy URL (psycopg 3) of a database on a new server."""
    root = Path(tempfile.mkdtemp(prefix="shoal-pg-"))
    data, port = root / "data", _free_port()
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb and postgres refuse root: run them as `postgres`
        shutil.chown(root, "postgres")
        root.chmod(0o755)
        as_user = [str(_runuser()), "-u", "postgres", "--"]

    def run(*cmd: str) -> None:
        subprocess.run([*as_user, *cmd], check=True, capture_output=True, timeout=120)

    run(_bin("initdb"), "-D", str(data), "-U", "shoal", "--auth=trust", "-E", "UTF8")
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    run(_bin("pg_ctl"), "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start")
    try:
        yield f"postgresql+psycopg://shoal@127.0.0.1:{port}/postgres"
    finally:
        with contextlib.suppress(Exception):
            run(_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)
