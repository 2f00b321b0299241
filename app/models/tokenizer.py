"""Tokenizer and chat template, from transformers, for the same sources as the weights."""

from typing import Any

from app.models.source import ModelSource
from app.protocol.errors import ModelLoadError


def load_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    try:
        if source.is_gguf:
            return AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
        return AutoTokenizer.from_pretrained(str(source.directory))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(source.name, f"cannot load its tokenizer: {exc}") from exc
