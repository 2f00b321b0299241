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


def chat_token_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt's token ids under the model's chat template, ready for the reply."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding in newer releases
        ids = ids["input_ids"]
    return list(ids)
