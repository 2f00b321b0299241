"""Every curl command in README, run as written (bash, the real curl) against the live
default app: a reader who pastes them gets answers, not errors. Blocks that need what a
test machine has not got are named here with the reason, so a new one is never skipped
unnoticed."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
# A block mentioning one of these is not run here, for the reason given.
NOT_HERE = {
    "kubectl": "needs a Kubernetes cluster (k8s/ is checked by tests/k8s)",
    "api/downloads/enqueue": "downloads from the Hugging Face Hub (tests/serve/test_operator_live.py "
    "runs the same calls against a local fixture hub)",
}


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)


def _curl_blocks() -> list[str]:
    return [
        b for b in _bash_blocks() if "curl " in b and not any(marker in b for marker in NOT_HERE)
    ]


def _answers(output: str) -> list:
    """The JSON values a block printed: whole documents, or SSE `data:` lines."""
    values, decoder, rest = [], json.JSONDecoder(), output.strip()
    if rest.startswith(("data:", "event:")):
        for line in rest.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                values.append(json.loads(line[6:]))
        return values
    while rest:
        value, end = decoder.raw_decode(rest)
        values.append(value)
        rest = rest[end:].strip()
    return values


def test_every_readme_curl_block_is_run_or_named():
    blocks = [b for b in _bash_blocks() if "curl " in b]
    run = _curl_blocks()
    assert len(run) >= 4  # the chat, Parrot, Responses and Messages examples at least
    for block in blocks:
        assert block in run or any(m in block for m in NOT_HERE)


def _block_id(block: str) -> str:
    match = re.search(r":8000(/[\w/.-]*)", block)
    return match.group(1) if match else block[:20]


@pytest.mark.parametrize("block", _curl_blocks(), ids=_block_id)
def test_readme_curl_block_as_written(serve_app, block):
    assert shutil.which("curl"), "curl is needed to run README's commands"
    done = subprocess.run(
        ["bash", "-c", block], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    answers = _answers(done.stdout)
    assert answers, done.stdout
    for answer in answers:  # a Response carries "error": null; Anthropic's errors a type
        failed = isinstance(answer, dict) and (answer.get("error") or answer.get("type") == "error")
        assert not failed, answer
