"""A sequence's images: where their encoder rows go and when they are computed.

At admission each image's placeholder tokens are renamed in the sequence to one id past
the vocabulary, drawn from the image's content hash, so that the prefix cache (which
keys blocks by token ids) matches a repeated image and never two different ones; the
model reads those positions' rows from the encoder instead of its embedding table. An
image is encoded when a step first computes part of its span (not at all when the cache
held it), its rows kept until the span is computed. A prefill chunk never ends inside an
image's span (`chunk_end`)."""

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from app.protocol.errors import InvalidRequestError
from app.protocol.images import ImageInput

# An image's placeholder ids: vocab + content_hash % PSEUDO_IDS. Its hash is all that tells
# two images' KV apart, so it keeps 62 bits (ids are int64): a collision would serve one
# image's KV for another's.
PSEUDO_IDS = 1 << 62


@dataclass
class SeqImage:
    start: int  # its span of the prompt [start, end)
    end: int
    positions: np.ndarray  # those that take the encoder's rows, in order
    pixels: dict[str, Any]
    both_ways: bool = False  # its tokens see each other both ways (Gemma 3's)
    rows: torch.Tensor | None = None  # the encoder's output while the span is computed


def attach(tokens: list[int], images: Seq[ImageInput], vision: Any, vocab: int) -> list[SeqImage]:
    """The images of a prompt, checked against it, their placeholders renamed in `tokens`
    (in place). A model without an encoder refuses them."""
    if not images:
        return []
    if vision is None:
        raise InvalidRequestError(
            "image input is not supported: this model does not read images; send text only",
            "messages",
        )
    attached: list[SeqImage] = []
    end = 0
    for image in sorted(images, key=lambda i: i.offset):
        start = image.offset
        if start < end or start + image.length > len(tokens) or image.length <= 0:
            raise InvalidRequestError("image spans overlap or fall outside the prompt")
        end = start + image.length
        span = np.asarray(tokens[start:end])
        positions = start + np.flatnonzero(span == vision.image_token_id)
        try:
            expected = vision.rows(image.pixels)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "messages") from exc
        if len(positions) != expected:
            raise InvalidRequestError(
                f"an image of {expected} encoder rows has {len(positions)} placeholder tokens"
            )
        pseudo = vocab + image.content_hash % PSEUDO_IDS
        for p in positions.tolist():
            tokens[p] = pseudo
        both_ways = bool(getattr(vision, "bidirectional", False))
        attached.append(SeqImage(start, end, positions, image.pixels, both_ways))
    return attached


def chunk_end(images: list[SeqImage], start: int, end: int) -> int:
    """Where a prefill chunk [start, end) may end: before an image it would cut into,
    or past the end of one it starts inside (a step a little over its budget)."""
    for image in images:
        if image.start < end < image.end:
            return image.start if image.start > start else image.end
    return end


def encode_due(vision: Any, seqs: Seq[Any], counts: Seq[int]) -> None:
    """Encode, in one call, the images whose spans these chunks start to compute."""
    due = [
        image
        for seq, n in zip(seqs, counts, strict=True)
        for image in seq.images
        if image.rows is None
        and image.start < seq.num_computed_tokens + n
        and image.end > seq.num_computed_tokens
    ]
    if due:
        for image, rows in zip(due, vision([i.pixels for i in due]), strict=True):
            image.rows = rows


def step_rows(
    seqs: Seq[Any], starts: Seq[int], counts: Seq[int]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The flat-batch rows of a step that take encoder rows, and those rows."""
    rows, values = [], []
    flat = 0
    for seq, start, n in zip(seqs, starts, counts, strict=True):
        for image in seq.images:
            if image.end <= start or image.start >= start + n:
                continue
            inside = (image.positions >= start) & (image.positions < start + n)
            if inside.any():
                rows.append(torch.from_numpy(flat + image.positions[inside] - start))
                values.append(image.rows[torch.from_numpy(np.flatnonzero(inside))])
        flat += n
    if not rows:
        return None
    return torch.cat(rows), torch.cat(values)


def sees_both_ways(seq: Any, n: int) -> bool:
    """Whether the chunk of `n` tokens the sequence computes next holds an image whose
    tokens see each other both ways."""
    start = seq.num_computed_tokens  # one token alone is a prompt's last: nothing after it
    return n > 1 and any(i.both_ways and i.start < start + n and i.end > start for i in seq.images)


def both_ways_spans(
    seqs: Seq[Any], starts: Seq[int], counts: Seq[int]
) -> tuple[tuple[int, int, int], ...]:
    """(index in the step, start, end) of the images a step computes whose tokens see
    each other both ways (BatchLayout.both_ways)."""
    return tuple(
        (i, image.start, image.end)
        for i, (seq, start, n) in enumerate(zip(seqs, starts, counts, strict=True))
        for image in seq.images
        if n > 1 and image.both_ways and image.start < start + n and image.end > start
    )


def release_computed(seqs: Seq[Any]) -> None:
    """Drop encoder rows whose span is computed (a preempted sequence encodes again)."""
    for seq in seqs:
        for image in seq.images:
            if image.rows is not None and seq.num_computed_tokens >= image.end:
                image.rows = None
