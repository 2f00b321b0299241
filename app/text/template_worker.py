"""One chat template worker: a process running template_child.py, with an address-space
limit, answering one JSON line per request line (request_template.py says why).

Its caller times every answer: a worker that does not answer within the time given
raises TimeoutError, one that died EOFError; the caller then kills it (`kill`).
"""

import contextlib
import json
import math
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

from app.protocol.errors import ShoalError

START_TIMEOUT_S = 60.0  # a new worker imports transformers' renderer first (~1 s)
LOAD_TIMEOUT_S = 60.0  # a worker reads a model's tokenizer (~0.3 s for SmolLM2's)
MEMORY_LIMIT_BYTES = 1 << 30  # each worker's address space
CHILD_TOKENIZERS = 2  # tokenizers a worker keeps loaded (the least recently used goes)
CHILD = Path(__file__).with_name("template_child.py")


class TemplateWorker:
    def __init__(self, timeout_s: float) -> None:
        args = [str(MEMORY_LIMIT_BYTES), str(math.ceil(timeout_s)), str(CHILD_TOKENIZERS)]
        # One thread and few malloc arenas: each arena reserves 64 MiB of address space.
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "MALLOC_ARENA_MAX": "2"}
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            self._read(START_TIMEOUT_S)
        except (TimeoutError, EOFError) as exc:
            self.kill()
            raise ShoalError("the chat template renderer did not start") from exc

    def ask(self, line: str, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def load(self, key: str, source: str) -> bool:
        try:
            answer = self.ask(json.dumps({"load": key, "json": source}), LOAD_TIMEOUT_S)
        except (TimeoutError, EOFError, OSError):
            self.kill()
            return False
        return bool(answer.get("loaded"))

    def _read(self, timeout_s: float) -> dict[str, Any]:
        out = self.proc.stdout
        assert out is not None
        poll = select.poll()  # not select(): a descriptor past 1024 is fine
        poll.register(out, select.POLLIN)
        if not poll.poll(timeout_s * 1000):
            raise TimeoutError
        line = out.readline()  # the child writes whole lines; a partial one means it died
        if not line.endswith("\n"):
            raise EOFError
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a line half written to a dead worker
                    pipe.close()
