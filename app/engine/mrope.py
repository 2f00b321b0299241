"""3-D rotary positions (M-RoPE, Qwen2.5-VL) of a sequence with images.

Text tokens count up one by one, their three positions (temporal, row, column) alike. An
image's tokens take its merged grid's (t, row, column), each offset by the position the
image starts at; the text after it resumes at that start plus the grid's larger side, so
an image takes fewer positions than tokens. Past the prompt every token is text: its
position is its index plus the prompt's `delta` (what its images saved, <= 0)."""

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RopePositions:
    prompt: np.ndarray  # (3, P) int64
    delta: int

    def of(self, start: int, n: int) -> np.ndarray:
        """(3, n) the positions of tokens [start, start + n)."""
        length = self.prompt.shape[1]
        head = self.prompt[:, start : min(start + n, length)]
        tail = np.arange(max(start, length), start + n, dtype=np.int64) + self.delta
        return np.concatenate([head, np.broadcast_to(tail, (3, len(tail)))], axis=1)


def rope_positions(length: int, images: Seq[Any], vision: Any) -> RopePositions | None:
    """The prompt's positions, for an encoder whose language model takes 3-D ones (it
    has `grid`); None otherwise (positions are then the tokens' indices)."""
    if not images or not hasattr(vision, "grid"):
        return None
    out = np.empty((3, length), dtype=np.int64)
    at = position = 0
    for image in images:  # by position; an image's tokens are its span, [start, end)
        t, h, w = vision.grid(image.pixels)
        out[:, at : image.start] = position + np.arange(image.start - at)
        position += image.start - at
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
        out[:, image.start : image.end] = grid.reshape(3, -1) + position
        position += max(h, w)
        at = image.end
    out[:, at:] = position + np.arange(length - at)
    return RopePositions(out, int(out.max()) + 1 - length)


def step_positions(
    seqs: Seq[Any], starts: Seq[int], counts: Seq[int], flat: np.ndarray
) -> np.ndarray | None:
    """(3, T) the step's positions where a sequence has 3-D ones; None where none has.
    `flat`: the tokens' indices, (T,)."""
    if not any(seq.rope is not None for seq in seqs):
        return None
    parts, offset = [], 0
    for seq, start, n in zip(seqs, starts, counts, strict=True):
        if seq.rope is not None:
            parts.append(seq.rope.of(start, n))
        else:
            parts.append(np.broadcast_to(flat[offset : offset + n], (3, n)))
        offset += n
    return np.concatenate(parts, axis=1)
