"""Prompt pieces that more than one dialect takes: llama.cpp's JSON prompt objects, which
llama-server also accepts in OpenAI's /v1/completions and /v1/embeddings, and the media
they may carry (images in `multimodal_data`, each standing at a MEDIA_MARKER of the
text, as libmtmd reads them)."""

from dataclasses import dataclass, replace
from typing import Any

from app.protocol.errors import InvalidRequestError
from app.protocol.images import ImageInput
from app.text.images import base64_bytes
from deployments.ingress import Ingress, unwrap

MEDIA_MARKER = "<__media__>"  # libmtmd's default; /props names it as `media_marker`


@dataclass(frozen=True)
class MediaPrompt:
    """A prompt object with media: `text`, whose MEDIA_MARKERs stand, in order, for
    `images` (their bytes)."""

    text: str
    images: tuple[bytes, ...]


def prompt_object(item: dict[str, Any], param: str) -> str | MediaPrompt:
    """A JSON prompt object's text, or its text and media (see `prompt_object_text`)."""
    media = item.get("multimodal_data")
    if media is None or media == []:
        return prompt_object_text(item, param)
    if not isinstance(media, list) or not all(isinstance(m, str) for m in media):
        raise InvalidRequestError("multimodal_data is a list of base64 strings", param)
    text = prompt_object_text({k: v for k, v in item.items() if k != "multimodal_data"}, param)
    return MediaPrompt(text, tuple(base64_bytes(m, param) for m in media))


def prompt_object_text(item: dict[str, Any], param: str) -> str:
    """The text of llama.cpp's JSON prompt objects: {"prompt_string": text} or {"content":
    [text parts]}. Media in `multimodal_data` is refused: the routes that take it read
    prompt objects with `prompt_object`."""
    if item.get("multimodal_data"):
        raise InvalidRequestError(
            "multimodal_data is not supported here: send images to /completion or "
            "/v1/chat/completions",
            param,
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


def check_media_count(prompts: list[list[Any]], limit: int) -> None:
    """The images of every prompt of a request together stay within `limit` (400)."""
    count = sum(len(p.images) for pieces in prompts for p in pieces if isinstance(p, MediaPrompt))
    if count > limit:
        raise InvalidRequestError(f"{count} images in a request; at most {limit}", "prompt")


async def encode_media_prompt(
    ingress: Ingress, model: str, prompt: MediaPrompt, add_special: bool, offset: int = 0
) -> tuple[list[int], list[ImageInput]]:
    """The prompt's ids, each marker expanded into its image's tokens by the model's
    processor, and the images at their spans, counted from `offset` (the ids before)."""
    source = ingress.model(model).engine.model
    call = ingress.tokenizer.encode_with_images
    try:
        ids, images = await call.remote(
            model, prompt.text, list(prompt.images), MEDIA_MARKER, add_special, source
        )
    except Exception as exc:
        raise unwrap(exc) from None
    return ids, [replace(image, offset=image.offset + offset) for image in images]
