"""Run llama.cpp's own server test suite against a running Shoal: a drop-in check.

llama.cpp keeps its server's tests in its repository (tools/server/tests: pytest, with a
harness, utils.py, whose ServerProcess starts llama-server for each test). This script
fetches nothing and changes no test: given the path of that directory (from a checkout
of llama.cpp you made), it loads a pytest plugin that replaces ServerProcess.start() by
"wait until the running server at --url answers /health" and ServerProcess.stop() by
nothing, runs the suite, and prints passed / failed / skipped / error counts per file.

    python scripts/llamacpp_suite.py ~/llama.cpp/tools/server/tests [--url URL]
        [--json outcomes.json] [pytest args, e.g. unit/test_completion.py -x]

Tests that set start-up flags (a model, --ctx-size, --lora, an API key...) run against
the server as it was started, so they say what a client of this server would see.
Needs the suite's own requirements (requests, openai, ...) in the running Python.
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PLUGIN = """
import json, sys, time
from collections import defaultdict
from urllib.parse import urlparse

import pytest
import requests

URL = {url!r}
OUT = {out!r}
outcomes = {{}}


def pytest_configure(config):
    import utils

    parsed = urlparse(URL)

    def start(self, timeout_seconds=60):
        self.server_host, self.server_port = parsed.hostname, parsed.port or 80
        utils.server_instances.add(self)
        deadline = time.time() + timeout_seconds
        while True:
            try:
                if requests.get(URL + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"{{URL}} did not answer /health")
            time.sleep(0.5)

    def stop(self):
        utils.server_instances.discard(self)

    utils.ServerProcess.start = start
    utils.ServerProcess.stop = stop


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        old = outcomes.get(report.nodeid)
        if old is None or old == "passed":
            kind = report.outcome if report.when == "call" else (
                "skipped" if report.outcome == "skipped" else "error"
            )
            outcomes[report.nodeid] = kind


def pytest_sessionfinish(session):
    table = defaultdict(lambda: defaultdict(int))
    for nodeid, kind in outcomes.items():
        table[nodeid.split("::")[0]][kind] += 1
    kinds = ("passed", "failed", "skipped", "error")
    print("\\n" + f"{{'file':44}}" + "".join(f"{{k:>9}}" for k in kinds))
    totals = defaultdict(int)
    for name in sorted(table):
        print(f"{{name:44}}" + "".join(f"{{table[name][k]:>9}}" for k in kinds))
        for k in kinds:
            totals[k] += table[name][k]
    print(f"{{'total':44}}" + "".join(f"{{totals[k]:>9}}" for k in kinds))
    if OUT:
        with open(OUT, "w") as f:
            json.dump(outcomes, f, indent=1, sort_keys=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", type=Path, help="llama.cpp's tools/server/tests directory")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--json", type=Path, help="write every test's outcome here")
    args, pytest_args = parser.parse_known_args()
    tests = args.tests.resolve()
    if not (tests / "utils.py").is_file():
        sys.exit(f"{tests} is not llama.cpp's tools/server/tests (no utils.py)")
    out = str(args.json.resolve()) if args.json else ""
    with tempfile.TemporaryDirectory() as plugin_dir:
        Path(plugin_dir, "shoal_harness.py").write_text(PLUGIN.format(url=args.url, out=out))
        env_path = f"{plugin_dir}:{tests}"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "shoal_harness",
            "-q",
            "-p",
            "no:cacheprovider",
        ]
        command += pytest_args or ["unit"]
        done = subprocess.run(command, cwd=tests, env={**os.environ, "PYTHONPATH": env_path})
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
