"""llama.cpp as a peer in our benchmarks, run side by side on the same GGUF file.

Nothing here fetches or builds llama.cpp. Build it from its source with the Debian
toolchain (e.g. `cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build
--target llama-server llama-bench llama-perplexity`) and point `--llama-cpp` (or
SHOAL_LLAMA_CPP) at the directory holding the binaries; without them the benches print
Shoal's figures alone.

- `llama_bench`: its own in-process figures (llama-bench): decode ms/token, prompt time.
- `LlamaServer`: llama-server on a local port, started and stopped (SIGTERM) by the bench.
- `perplexity`: llama-perplexity's final estimate over a text file.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

ENV = "SHOAL_LLAMA_CPP"


def find(name: str, directory: str | None = None) -> str | None:
    """The path of llama.cpp's `name` binary in `directory`, $SHOAL_LLAMA_CPP or PATH."""
    for base in (directory, os.environ.get(ENV)):
        if base:
            for candidate in (Path(base) / name, Path(base) / "bin" / name):
                if candidate.is_file() and os.access(candidate, os.X_OK):
                    return str(candidate)
    return shutil.which(name)


def llama_bench(binary: str, model: str, threads: int, prompt: int = 512, gen: int = 128) -> dict:
    """llama-bench's means over 3 repetitions: decode ms/token (a `gen`-token generation
    after an empty context) and the time to process a `prompt`-token prompt."""
    cmd = [binary, "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(gen)]
    out = subprocess.run(
        [*cmd, "-r", "3", "-o", "json"], capture_output=True, text=True, timeout=900, check=True
    ).stdout
    result = {}
    for test in json.loads(out):
        seconds = test["avg_ns"] / 1e9
        if test["n_gen"]:
            result["decode_ms"] = round(1000 * seconds / test["n_gen"], 2)
        else:
            result[f"prompt_{test['n_prompt']}_ms"] = round(1000 * seconds, 1)
    return result


def perplexity(binary: str, model: str, text_file: str, threads: int, ctx: int) -> float:
    """llama-perplexity's estimate over `text_file` in windows of `ctx` tokens (it scores
    the second half of each window, as our bench/quant_quality.py does)."""
    proc = subprocess.run(
        [binary, "-m", model, "-f", text_file, "-t", str(threads), "-c", str(ctx), "-b", str(ctx)],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout + proc.stderr)
    if not found:
        raise RuntimeError(f"no estimate in llama-perplexity's output:\n{proc.stderr[-2000:]}")
    return float(found.group(1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server for the duration of a `with`: `slots` parallel sequences, each with
    `ctx_per_slot` tokens of context, answering OpenAI's routes at `.url`."""

    def __init__(
        self, binary: str, model: str, threads: int, port: int | None, slots: int, ctx_per_slot: int
    ) -> None:
        port = port or free_port()  # a fixed one may still be held by the Ray just shut down
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [
            binary,
            "-m",
            model,
            "-t",
            str(threads),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-np",
            str(slots),
            "-c",
            str(slots * ctx_per_slot),
            "--no-webui",
        ]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        import httpx

        # Its log goes to a file: an unread pipe fills and stalls the server's log thread.
        self.log = tempfile.TemporaryFile(mode="w+b")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError("llama-server did not become healthy in 120 s")

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the server's log. pread: the server shares the file's offset, and a
        seek would move where it writes next."""
        fd = self.log.fileno()
        size = os.fstat(fd).st_size
        start = max(0, size - 4 * chars)
        return os.pread(fd, size - start, start).decode(errors="replace")[-chars:]

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
