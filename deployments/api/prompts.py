"""Prompt pieces that more than one dialect takes: llama.cpp's JSON prompt objects, which
llama-server also accepts in OpenAI's /v1/completions and /v1/embeddings."""

from typing import Any

from app.protocol.errors import InvalidRequestError


def prompt_object_text(item: dict[str, Any], param: str) -> str:
    """The text of llama.cpp's JSON prompt objects: {"prompt_string": text} (media in
    `multimodal_data` refused: images go through the chat routes) or {"content": [text parts]}."""
    if item.get("multimodal_data"):
        raise InvalidRequestError(
            "multimodal_data is not supported here: send images to /v1/chat/completions", param
        )
    if isinstance(item.get("prompt_string"), str):
        return item["prompt_string"]
    parts = item.get("content")
    if not isinstance(parts, list) or not parts:
        raise InvalidRequestError(
            'a prompt object is {"prompt_string": text} or {"content": [text parts]}', param
        )
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(f"content parts of type {kind!r} are not supported", param)
        texts.append(str(part.get("text", "")))
    return "".join(texts)
