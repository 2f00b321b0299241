"""Every curl command in README.md and docs/*.md, run as written (bash, the real curl)
against the live default app: a reader who pastes them gets answers, not errors. Blocks
that need what a test machine has not got are named here with the reason, so a new one is
never skipped unnoticed. A block that appears in several files is run once."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# A block mentioning one of these is not run here, for the reason given.
NOT_HERE = {
    "kubectl": "needs a Kubernetes cluster (k8s/ is checked by tests/k8s)",
    "api/downloads/enqueue": "downloads from the Hugging Face Hub (tests/serve/test_operator_live.py "
    "runs the same calls against a local fixture hub)",
    "load_lora_adapter": "needs a LoRA adapter under the models directory "
    "(tests/serve/test_lora_live.py runs the same calls on a peft-made one)",
}


def _bash_blocks(*paths: Path) -> dict[str, Path]:
    """Each ```bash block of `paths` (README and docs/*.md by default), with the first file
    that has it."""
    blocks: dict[str, Path] = {}
    for path in paths or (README, *DOCS):
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
            blocks.setdefault(block, path)
    return blocks


def _runnable(block: str) -> bool:
    return "curl " in block and not any(marker in block for marker in NOT_HERE)


def _curl_blocks(*paths: Path) -> list[str]:
    return [b for b in _bash_blocks(*paths) if _runnable(b)]


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
    assert ROOT / "docs" / "apis.md" in DOCS  # the dialects' full documentation
    # README's own examples: chat, Parrot, Responses and Messages at least
    assert len(_curl_blocks(README)) >= 4
    blocks = [b for b in _bash_blocks() if "curl " in b]
    run = _curl_blocks()
    for block in blocks:
        assert block in run or any(m in block for m in NOT_HERE)


def _block_id(block: str) -> str:
    match = re.search(r":8000(/[\w/.-]*)", block)
    return f"{_bash_blocks()[block].name}:{match.group(1) if match else block[:20]}"


@pytest.mark.parametrize("block", _curl_blocks(), ids=_block_id)
def test_readme_curl_block_as_written(serve_app, block):
    assert shutil.which("curl"), "curl is needed to run the documents' commands"
    done = subprocess.run(
        ["bash", "-c", block], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    answers = _answers(done.stdout)
    assert answers, done.stdout
    # a Response carries "error": null, an Assistants run "last_error"; Anthropic's errors a type
    for answer in answers:
        failed = isinstance(answer, dict) and (
            answer.get("error") or answer.get("last_error") or answer.get("type") == "error"
        )
        assert not failed, answer
