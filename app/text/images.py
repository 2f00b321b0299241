"""Images of a prompt on the tokenizer's side: bytes checked and decoded (bounded before
any pixel is decoded), then through the model's own processor (transformers', on Pillow),
which sizes each image's placeholder tokens and gives the encoder's pixels.

The rendered chat prompt holds one placeholder string per image (the template's); each
image goes through the processor on its own, which gives its pixels and its expansion
(the tokens its placeholder becomes). The expanded prompt is then tokenized whole, as
the processor tokenizes it: an expansion may begin or end in plain text (Gemma 3's
newlines), which merges with the text beside it. An image's span runs from its first
placeholder token to its last, and the prompt's count of placeholder tokens must be the
expansions' (a text that writes such tokens itself is refused)."""

import base64
import binascii
import copy
import hashlib
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.models.source import ModelSource
from app.protocol.errors import InvalidRequestError
from app.protocol.images import ImageInput
from app.text.processors import PROCESSOR_CLASSES, QwenProcessor, projector_processor

_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")  # the only decoders Pillow tries
OPENED_AS = frozenset({*IMAGE_FORMATS, "MPO"})  # MPO: many phones' JPEGs, read as JPEG


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8  # a request's
    max_bytes: int = 20 * 2**20  # an image's, encoded
    max_pixels: int = 7680 * 4320  # an image's, width x height, read from its header
    max_tokens: int = 8192  # a request's image placeholder tokens, all images together


def load_processor(
    source: ModelSource,
    mmproj: str | None = None,
    tokenizer: Any = None,
    limits: ImageLimits | None = None,
) -> Any | None:
    """The model's processor when its files name one (a multimodal checkpoint), or, with
    llama.cpp's projector file `mmproj`, one made from its metadata over `tokenizer`
    (the model's, copied: a processor may add tokens to it); else None. `limits`: a
    processor that sizes images freely (Qwen's) scales them down to fit its tokens."""
    max_tokens = (limits or ImageLimits()).max_tokens
    if mmproj is not None:
        return projector_processor(mmproj, source.name, copy.deepcopy(tokenizer), max_tokens)
    directory = source.directory
    if source.is_gguf or not any(
        (directory / name).is_file()
        for name in ("processor_config.json", "preprocessor_config.json")
    ):
        return None
    if _processor_class(directory) in PROCESSOR_CLASSES:
        return QwenProcessor.from_directory(directory, max_tokens)
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(directory))


def _processor_class(directory: Path) -> str | None:
    for name in ("processor_config.json", "preprocessor_config.json"):
        if (directory / name).is_file():
            found = json.loads((directory / name).read_text()).get("processor_class")
            if found:
                return found
    return None


def placeholder(processor: Any) -> str:
    """The string the chat template writes for an image, which the processor expands."""
    return getattr(processor, "boi_token", None) or processor.image_token


def open_image(data: bytes, limits: ImageLimits) -> Any:
    """An RGB Pillow image of `data`; a 400 for what is too big, not an image, or
    corrupt. Size is checked from the header, so a decompression bomb never decodes."""
    from PIL import Image

    if len(data) > limits.max_bytes:
        raise InvalidRequestError(
            f"an image is {len(data)} bytes; at most {limits.max_bytes}", "messages"
        )
    too_many = f"an image of more than {limits.max_pixels} pixels"
    try:
        with warnings.catch_warnings():  # the bound below applies, read from the header
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:
        raise InvalidRequestError(f"{too_many}: {exc}", "messages") from exc
    except (OSError, ValueError, SyntaxError) as exc:
        raise InvalidRequestError(f"not an image this server reads: {exc}", "messages") from exc
    if image.format not in OPENED_AS:
        raise InvalidRequestError(f"image format {image.format} is not accepted", "messages")
    if image.width * image.height > limits.max_pixels:
        raise InvalidRequestError(f"{too_many}: {image.width}x{image.height}", "messages")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return image.convert("RGB")
    except (
        OSError,
        ValueError,
        SyntaxError,
        Image.DecompressionBombWarning,
        Image.DecompressionBombError,
    ) as exc:
        raise InvalidRequestError(f"a corrupt image: {exc}", "messages") from exc


def content_hash(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def encode_with_images(
    processor: Any,
    text: str,
    images: list[bytes],
    limits: ImageLimits,
    marker: str | None = None,
    add_special_tokens: bool = False,
) -> tuple[list[int], list[ImageInput]]:
    """The prompt's ids with each image's place expanded, and the images at their spans.
    An image's place is the template's placeholder, or `marker` in a raw prompt (which
    starts with the tokenizer's special tokens when `add_special_tokens`)."""
    if len(images) > limits.max_images:
        raise InvalidRequestError(
            f"{len(images)} images in a request; at most {limits.max_images}", "messages"
        )
    pieces = text.split(marker or placeholder(processor))
    if len(pieces) != len(images) + 1:
        raise InvalidRequestError(
            f"the prompt has {len(pieces) - 1} image places for {len(images)} images", "messages"
        )
    tokenizer = processor.tokenizer
    token = int(processor.image_token_ids[0])  # what the encoder's rows replace
    expansions, counts, pixels = [], [], []
    before, after = getattr(processor, "around_raw_image", ("", "")) if marker else ("", "")
    for data in images:
        picture = open_image(data, limits)
        try:
            out = processor(
                text=placeholder(processor), images=[[picture]], add_special_tokens=False
            )
        except ValueError as exc:  # e.g. Qwen's: an aspect ratio past 200
            raise InvalidRequestError(
                f"the model's processor refused an image: {exc}", "messages"
            ) from exc
        span = np.asarray(out["input_ids"]).reshape(-1)
        expansion = tokenizer.decode(span.tolist(), clean_up_tokenization_spaces=False)
        expansions.append(before + expansion + after)  # a raw prompt's: as its template writes
        counts.append(int((span == token).sum()))
        if counts[-1] == 0:
            raise InvalidRequestError("the model's processor gave an image no tokens", "messages")
        if sum(counts) > limits.max_tokens:  # before pixels pile up (Qwen's: 5 KiB a token)
            raise InvalidRequestError(
                f"the request's images take more than {limits.max_tokens} tokens: send fewer "
                "or smaller images",
                "messages",
            )
        arrays = {k: np.asarray(v) for k, v in out.items() if k not in _TEXT_KEYS}
        if "pixel_attention_mask" in arrays:  # int64 from the processor: 8x the bytes
            arrays["pixel_attention_mask"] = arrays["pixel_attention_mask"].astype(bool)
        pixels.append(arrays)
    whole = pieces[0] + "".join(e + p for e, p in zip(expansions, pieces[1:], strict=True))
    ids = [int(t) for t in tokenizer(whole, add_special_tokens=add_special_tokens).input_ids]
    places = np.flatnonzero(np.asarray(ids) == token)
    if len(places) != sum(counts):
        raise InvalidRequestError("the prompt's text holds image tokens of its own", "messages")
    inputs, at = [], 0
    for data, n, arrays in zip(images, counts, pixels, strict=True):
        first, last = int(places[at]), int(places[at + n - 1])
        inputs.append(ImageInput(content_hash(data), first, last - first + 1, arrays))
        at += n
    return ids, inputs


def take_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[bytes]]:
    """A chat turn's messages as templates take them ({"type": "image"} parts) and the
    images' bytes in the order the template shows them. Every dialect puts an image in
    a message's content as {"type": "image", "image": bytes} (an image URL's part,
    {"type": "image", "url": url}, is fetched by the ingress before it comes here)."""
    images: list[bytes] = []
    taken = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(p.get("type") == "image" for p in content):
            parts = []
            for part in content:
                if part.get("type") == "image":
                    images.append(part.get("image", b""))
                    part = {"type": "image"}
                parts.append(part)
            message = {**message, "content": parts}
        taken.append(message)
    return taken, images


def image_url_part(url: str, param: str) -> dict[str, Any]:
    """A chat turn's image part for an image URL: a data URL, or an http(s) URL (which the
    ingress fetches where the config allows). The part holds the URL, not yet its bytes,
    so that a stored turn (Responses) keeps it as JSON; the ingress reads it before the
    prompt is rendered (deployments/http/image_urls.py)."""
    if url.split(":", 1)[0].lower() not in ("data", "http", "https"):
        raise InvalidRequestError(
            "an image URL is a data URL (data:image/png;base64,...) or an http(s) URL", param
        )
    return {"type": "image", "url": url}


def data_url_bytes(url: str, param: str) -> bytes:
    """The bytes of a base64 data URL (data:image/png;base64,...)."""
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise InvalidRequestError("an image data URL must be base64 (;base64,)", param)
    return base64_bytes(payload, param)


def base64_bytes(text: str, param: str) -> bytes:
    text = "".join(text.split())  # MIME's line breaks
    text += "=" * (-len(text) % 4)  # and padding some encoders leave out
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error) as exc:
        raise InvalidRequestError(f"an image is not valid base64: {exc}", param) from exc
