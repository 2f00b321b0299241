"""The model's tokenizer as the ingress needs it, loaded without torch.

The ingress decodes (and encodes a fill-in-the-middle request's pieces; the Tokenizer
deployment renders and encodes the rest) and reads the chat template and special
tokens; transformers' TokenizersBackend does that over a `tokenizer.json` without
importing torch, but `AutoTokenizer` imports torch (through its config classes)
whenever torch is installed, and so does reading a GGUF's vocabulary. So a GGUF's
tokenizer, or a checkpoint's whose tokenizer class rebuilds the pipeline from its
vocabulary (LlamaTokenizer and the like), is loaded once by transformers itself, in a
child process when this one has no torch, and saved in the cache; every later start
loads those files. `load_tokenizer` loads a GGUF's this way too, so the Tokenizer
deployment and the ingress hold the same tokenizer. A process without torch this way
stays hundreds of MiB lighter.
"""

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import app
from app.models.source import ModelSource
from app.protocol.errors import ModelLoadError
from app.text.transformers_tokenizer import load_transformers_tokenizer, loaded_tokenizer

CONVERT_TIMEOUT_S = 300
# A conversion's staging directory older than this was left by a process killed midway:
# a running conversion writes into its own well within its timeout.
STALE_STAGING_S = 2 * CONVERT_TIMEOUT_S
# Tokenizer classes that load a checkpoint's tokenizer.json as written.
GENERIC_CLASSES = {None, "TokenizersBackend", "PreTrainedTokenizerFast"}


def load_light_tokenizer(source: ModelSource, chat_template: str | None = None) -> Any:
    """The model's tokenizer for decoding, its chat template and special tokens, without
    torch; `chat_template` (the model's configured override) replaces its own. A
    checkpoint with no `tokenizer.json` (a sentencepiece-only one) loads as
    transformers loads it."""
    directory = _as_written(source) or _converted(source)
    if not (directory / "tokenizer.json").is_file():
        return load_transformers_tokenizer(source, chat_template)
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    load = functools.partial(TokenizersBackend.from_pretrained, str(directory))
    return loaded_tokenizer(source.name, load, chat_template)


def _as_written(source: ModelSource) -> Path | None:
    """The checkpoint's own directory when transformers loads its `tokenizer.json` as
    written (no tokenizer class of its own, or a generic one); None when it must be
    converted: a GGUF, or a class (LlamaTokenizer, ...) that rebuilds the pipeline."""
    if source.is_gguf:
        return None
    config = source.directory / "tokenizer_config.json"
    if not (source.directory / "tokenizer.json").is_file():
        return source.directory
    try:
        named = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    except (OSError, ValueError):
        named = None
    return source.directory if named in GENERIC_CLASSES else None


def cache_root() -> Path:
    """Where converted tokenizers are kept: $SHOAL_CACHE_DIR, else ~/.cache/shoal, else
    (a read-only or missing home, as on a KubeRay pod) this user's directory under the
    temporary directory."""
    configured = os.environ.get("SHOAL_CACHE_DIR")
    candidates = [Path(configured)] if configured else []
    with contextlib.suppress(RuntimeError):  # no HOME and no passwd entry
        candidates.append(Path.home() / ".cache" / "shoal")
    candidates.append(Path(tempfile.gettempdir()) / f"shoal-cache-{os.getuid()}")
    for root in candidates:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(root, os.W_OK):
            return root
    raise ModelLoadError("tokenizer", f"no writable cache directory among {candidates}")


def _converted(source: ModelSource) -> Path:
    """The directory holding the tokenizer as transformers loads it, saved; made on first
    use (another process making it at the same time is harmless: the first rename wins,
    the loser's copy is dropped)."""
    origin = (source.directory / (source.gguf_file or "")).resolve()
    target = cache_root() / "tokenizers" / _key(origin)
    if (target / "tokenizer_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    drop_stale_staging(target.parent)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        if "torch" in sys.modules:  # already paid for: convert here
            save_tokenizer(origin, staging)
        else:
            _convert_in_child(source.name, origin, staging)
        staging.chmod(0o755)  # mkdtemp made it private; the cache is for every user
        try:
            staging.rename(target)
        except OSError:  # another process won the race
            if not (target / "tokenizer_config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def drop_stale_staging(directory: Path) -> None:
    """Remove the staging directories that conversions killed midway left in `directory`."""
    cutoff = time.time() - STALE_STAGING_S
    for staging in directory.glob(".convert-*"):
        with contextlib.suppress(OSError):  # another process removed it first
            if staging.stat().st_mtime < cutoff:
                shutil.rmtree(staging)


def save_tokenizer(origin: Path, directory: Path) -> None:
    """Write the tokenizer of `origin` (a GGUF file or a checkpoint directory), as
    transformers loads it, into `directory`."""
    if origin.is_dir():
        source = ModelSource(str(origin), origin)
    else:
        source = ModelSource(str(origin), origin.parent, origin.name)
    load_transformers_tokenizer(source).save_pretrained(directory)


def _convert_in_child(name: str, origin: Path, directory: Path) -> None:
    code = (
        "import sys; from pathlib import Path; "
        "from app.text.light_tokenizer import save_tokenizer; "
        "save_tokenizer(Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    # The package's own root first, so the child imports this very code.
    root = str(Path(app.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    try:
        result = subprocess.run(
            [sys.executable, "-c", code, str(origin), str(directory)],
            env=env,
            capture_output=True,
            text=True,
            timeout=CONVERT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise ModelLoadError(name, "converting its tokenizer timed out") from exc
    if result.returncode != 0:
        tail = result.stderr.strip().splitlines()[-1:] or ["no output"]
        raise ModelLoadError(name, f"cannot convert its tokenizer: {tail[0]}")


def _key(origin: Path) -> str:
    """The origin (path, and size and modification time of the file or of the
    directory's tokenizer files) and the libraries that convert and load it."""
    from importlib.metadata import version

    files = (
        [origin]
        if origin.is_file()
        else sorted(origin.glob("tokenizer*")) + sorted(origin.glob("special_tokens_map.json"))
    )
    parts = [str(origin), version("transformers"), version("tokenizers")]
    for path in files:
        stat = path.stat()
        parts += [path.name, str(stat.st_size), str(stat.st_mtime_ns)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
