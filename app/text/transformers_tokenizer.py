"""A tokenizer as transformers itself loads it from a model's source, and the model's
configured chat template put over it: the one loading both app.text.tokenizer and
app.text.light_tokenizer build on."""

from collections.abc import Callable
from typing import Any

from app.models.source import ModelSource
from app.protocol.errors import ModelLoadError


def load_transformers_tokenizer(source: ModelSource, chat_template: str | None = None) -> Any:
    """The tokenizer as transformers' AutoTokenizer loads it from the source itself."""
    from transformers import AutoTokenizer

    gguf = {"gguf_file": source.gguf_file} if source.is_gguf else {}
    if source.is_gguf:
        from app.models.gguf_configs import add_gguf_configs
        from app.models.gguf_reader import quick_gguf_reads

        quick_gguf_reads()
        add_gguf_configs()
    return loaded_tokenizer(
        source.name,
        lambda: AutoTokenizer.from_pretrained(str(source.directory), **gguf),
        chat_template,
    )


def loaded_tokenizer(name: str, load: Callable[[], Any], chat_template: str | None) -> Any:
    """`load()`'s tokenizer (its failure a ModelLoadError), under `chat_template` when
    the model's config overrides its own."""
    try:
        tokenizer = load()
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(name, f"cannot load its tokenizer: {exc}") from exc
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
