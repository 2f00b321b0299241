"""The model's tokenizer as the ingress needs it, loaded without torch.

The ingress only decodes (the Tokenizer deployment encodes and renders) and reads the
chat template and special tokens; transformers' TokenizersBackend does that over a
`tokenizer.json` without importing torch, but `AutoTokenizer` imports torch (through
its config classes) whenever torch is installed, and so does reading a GGUF's
vocabulary. So a GGUF's tokenizer is converted once, by transformers itself (the same
conversion `load_tokenizer` does), in a child process when this one has no torch, and
kept as files in the cache; every later start loads those files. A process without
torch this way stays hundreds of MiB lighter.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import app
from app.models.source import ModelSource
from app.protocol.errors import ModelLoadError

CONVERT_TIMEOUT_S = 300


def load_light_tokenizer(source: ModelSource, chat_template: str | None = None) -> Any:
    """The model's tokenizer for decoding, its chat template and special tokens, without
    torch; `chat_template` (the model's configured override) replaces its own. A
    checkpoint with no `tokenizer.json` (a sentencepiece-only one) loads as
    `load_tokenizer` loads it."""
    directory = _converted_gguf(source) if source.is_gguf else source.directory
    if not (directory / "tokenizer.json").is_file():
        from app.text.tokenizer import load_tokenizer

        return load_tokenizer(source, chat_template)
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    try:
        tokenizer = TokenizersBackend.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(source.name, f"cannot load its tokenizer: {exc}") from exc
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def cache_root() -> Path:
    """Where converted tokenizers are kept: $SHOAL_CACHE_DIR, else ~/.cache/shoal, else
    (a read-only home, as on a KubeRay pod) the temporary directory."""
    configured = os.environ.get("SHOAL_CACHE_DIR")
    candidates = [Path(configured)] if configured else []
    candidates += [Path.home() / ".cache" / "shoal", Path(tempfile.gettempdir()) / "shoal-cache"]
    for root in candidates:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(root, os.W_OK):
            return root
    raise ModelLoadError("tokenizer", f"no writable cache directory among {candidates}")


def _converted_gguf(source: ModelSource) -> Path:
    """The directory holding the GGUF's tokenizer as transformers converts it; made on
    first use (another process making it at the same time is harmless: the first
    rename wins, the loser's copy is dropped)."""
    gguf = (source.directory / source.gguf_file).resolve()
    target = cache_root() / "tokenizers" / _key(gguf)
    if (target / "tokenizer_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        if "torch" in sys.modules:  # already paid for: convert here
            save_gguf_tokenizer(gguf, staging)
        else:
            _convert_in_child(source.name, gguf, staging)
        staging.chmod(0o755)  # mkdtemp made it private; the cache is for every user
        try:
            staging.rename(target)
        except OSError:  # another process won the race
            if not (target / "tokenizer_config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def save_gguf_tokenizer(gguf: Path, directory: Path) -> None:
    """Write the GGUF's tokenizer (as `load_tokenizer` loads it) into `directory`."""
    from app.text.tokenizer import load_tokenizer

    load_tokenizer(ModelSource(str(gguf), gguf.parent, gguf.name)).save_pretrained(directory)


def _convert_in_child(name: str, gguf: Path, directory: Path) -> None:
    code = (
        "import sys; from pathlib import Path; "
        "from app.text.light_tokenizer import save_gguf_tokenizer; "
        "save_gguf_tokenizer(Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    # The package's own root first, so the child imports this very code.
    root = str(Path(app.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    try:
        result = subprocess.run(
            [sys.executable, "-c", code, str(gguf), str(directory)],
            env=env,
            capture_output=True,
            text=True,
            timeout=CONVERT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise ModelLoadError(name, "converting its GGUF tokenizer timed out") from exc
    if result.returncode != 0:
        tail = result.stderr.strip().splitlines()[-1:] or ["no output"]
        raise ModelLoadError(name, f"cannot convert its GGUF tokenizer: {tail[0]}")


def _key(gguf: Path) -> str:
    """The file (path, size, modification time) and the transformers that converts it."""
    from importlib.metadata import version

    stat = gguf.stat()
    text = f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}\0{version('transformers')}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]
