"""Text out of an HTML page or a PDF, in a process of its own, bounded in time and memory
(`extract_in_child`): the parsers these need are not linear on hostile input (Python's
html.parser takes minutes on a MiB of "<a<a<a...", a PDF's object graph can be made to
inflate), and a thread running one cannot be stopped. A child that overruns is killed;
the file fails with an error that says so, and the ingestor goes on with the next.

Run as `python -m deployments.retrieval.extract_child PATH MEDIA_TYPE MAX_CHARS MEMORY`:
one line of JSON on stdout, `{"text": ...}` or `{"error": {"code", "message"}}`.
"""

import json
import resource
import subprocess
import sys
from pathlib import Path

from deployments.retrieval.extract import ExtractionError, extract_text

CHILD_S = 60.0  # one file's extraction; real pages and PDFs take a second or a few
CHILD_MEMORY = 2 * 1024**3  # address space: pypdf and the text of a large file fit


def extract_in_child(
    path: Path, media_type: str, max_chars: int, timeout_s: float = CHILD_S
) -> str:
    """extract_text's answer, from a child process; ExtractionError past `timeout_s`, past
    the memory bound, or when the child fails in any other way."""
    argv = [sys.executable, "-m", __name__, str(path), media_type, str(max_chars)]
    try:
        done = subprocess.run(
            [*argv, str(CHILD_MEMORY)], capture_output=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise ExtractionError(
            f"reading the file's text took more than {timeout_s:g} s (malformed or hostile?)"
        ) from None
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        why = "ran out of memory" if b"MemoryError" in done.stderr else f"exit {done.returncode}"
        raise ExtractionError(f"reading the file's text failed ({why})") from None
    if "error" in answer:
        error = ExtractionError(answer["error"]["message"])
        error.code = answer["error"]["code"]
        raise error
    return answer["text"]


def main() -> None:
    path, media_type, max_chars, memory = sys.argv[1:5]
    resource.setrlimit(resource.RLIMIT_AS, (int(memory), int(memory)))
    try:
        answer: dict = {"text": extract_text(Path(path), media_type, int(max_chars))}
    except ExtractionError as exc:
        answer = {"error": {"code": exc.code, "message": exc.message}}
    sys.stdout.write(json.dumps(answer))


if __name__ == "__main__":
    main()
