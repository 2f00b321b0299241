"""A request's own chat template (vLLM's `chat_template`), rendered apart and bounded.

The template is the client's code. transformers renders it in Jinja's immutable sandbox,
which keeps it from Python's internals but not from the CPU or memory: `{{ 9**9**9 }}`
or a macro that calls itself twice runs for hours, `{{ "x" * 10**10 }}` takes the
memory. So it is rendered, by transformers' own renderer (the one apply_chat_template
calls, in the same sandbox), in a child process (template_child.py) with an
address-space limit, a time limit and a bound on the text it returns; a child that
overruns is killed and replaced. Configured templates are the operator's and render
in-process, as before.

One child serves every request template in this process, one render at a time (a lock):
a render takes about a millisecond, a runaway one at most RENDER_TIMEOUT_S.
"""

import json
import select
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.protocol.errors import InvalidRequestError, ShoalError
from app.protocol.messages import PromptEnding

RENDER_TIMEOUT_S = 3.0
START_TIMEOUT_S = 60.0  # a new child imports transformers' renderer first (~1 s)
MEMORY_LIMIT_BYTES = 1 << 30  # the child's address space
MAX_PROMPT_CHARS = 8 << 20  # more text than any model's context holds
CHILD = Path(__file__).with_name("template_child.py")


@dataclass(frozen=True)
class RenderJob:
    template: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    ending: PromptEnding
    variables: dict[str, Any]  # the tokenizer's special tokens, then the request's


def render_request_template(job: RenderJob) -> str:
    """The prompt's text under the request's template; InvalidRequestError (400) for a
    template that fails, raises, or runs past its bounds."""
    global _child
    line = json.dumps(asdict(job), default=str)
    with _lock:
        if _child is None or _child.proc.poll() is not None:
            _child = _Child()
        try:
            answer = _child.run(line, RENDER_TIMEOUT_S)
        except TimeoutError:
            _child.kill()
            _child = None
            raise InvalidRequestError(
                f"chat template failed: its render ran over {RENDER_TIMEOUT_S:g} s",
                "chat_template",
            ) from None
        except (EOFError, OSError):  # the child died: its memory limit, a crash
            _child.kill()
            _child = None
            raise InvalidRequestError(
                "chat template failed: its render ran out of memory", "chat_template"
            ) from None
    if "error" in answer:
        raise InvalidRequestError(f"chat template failed: {answer['error']}", "chat_template")
    return answer["text"]


class _Child:
    def __init__(self) -> None:
        args = [str(MEMORY_LIMIT_BYTES), str(MAX_PROMPT_CHARS)]
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            self._read(START_TIMEOUT_S)
        except (TimeoutError, EOFError) as exc:
            self.kill()
            raise ShoalError("the chat template renderer did not start") from exc

    def run(self, line: str, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        out = self.proc.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], timeout_s)
        if not ready:
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
                pipe.close()


_lock = threading.Lock()
_child: _Child | None = None
