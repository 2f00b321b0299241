"""An image of a prompt, as the engine takes it: already through the model's image
processor (on the tokenizer's side, which also expanded its placeholder tokens)."""

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ImageInput:
    """`pixels`: the processor's arrays by name (pixel_values, and for some models a
    pixel_attention_mask), the encoder's input. The image stands in the prompt tokens
    [offset, offset + length): its placeholder tokens, which take the encoder's rows in
    order, and what the processor put between them (Idefics3's tile tags). The prefix
    cache tells images apart by `content_hash` (of the image's bytes), since their
    placeholder tokens are all alike."""

    content_hash: int
    offset: int
    length: int
    pixels: dict[str, Any]

    def __post_init__(self) -> None:
        # numpy, whatever the processor gave: torch tensors cross the pipe to an engine
        # process as shared-memory handles that only multiprocessing's children may open.
        arrays = {name: np.asarray(value) for name, value in self.pixels.items()}
        object.__setattr__(self, "pixels", arrays)
