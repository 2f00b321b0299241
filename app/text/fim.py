"""Fill-in-the-middle prompts (llama.cpp's /infill): the model's own markers around the
code before and after the gap."""

from typing import Any

from app.protocol.errors import InvalidRequestError

# StarCoder/Qwen-coder style, then CodeLlama style.
FIM_TOKENS = [("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<PRE>", "<SUF>", "<MID>")]


def fim_prompt(
    tokenizer: Any, prefix: str, suffix: str, extra: str | list[int], model: str
) -> list[int]:
    """<prefix marker> prefix <suffix marker> suffix <middle marker> [prompt]."""
    vocab = tokenizer.get_vocab()
    markers = next((m for m in FIM_TOKENS if all(t in vocab for t in m)), None)
    if markers is None:
        raise InvalidRequestError(
            f"model {model!r} has no fill-in-the-middle tokens "
            f"({', '.join(FIM_TOKENS[0])} or {', '.join(FIM_TOKENS[1])}), so /infill "
            "cannot be served for it",
            "model",
        )
    pre, suf, mid = (vocab[t] for t in markers)

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids) if text else []

    tail = enc(extra) if isinstance(extra, str) else list(extra)
    return [pre, *enc(prefix), suf, *enc(suffix), mid, *tail]
