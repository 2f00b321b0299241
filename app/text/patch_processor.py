"""Qwen2.5-VL's processor, built without transformers' processor class, which cannot be
made on a host without torchvision (it checks its video processor's class, even unused).
Transformers' own image processor (Pillow) still sizes each image and cuts it into
patches; its placeholder becomes one image token per merged 2 x 2 of patches, as
transformers' processor writes it (`replace_image_token`)."""

from pathlib import Path
from typing import Any

import numpy as np

PROCESSOR_CLASSES = ("Qwen2_5_VLProcessor", "Qwen2VLProcessor")


class PatchProcessor:
    """The surface app/text/images.py uses: `tokenizer`, `image_token`, `image_token_ids`
    and a call on one text and its images."""

    def __init__(self, directory: Path) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.image_processor = AutoImageProcessor.from_pretrained(str(directory))
        self.tokenizer = AutoTokenizer.from_pretrained(str(directory))
        self.image_token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"
        self.image_token_ids = [self.tokenizer.convert_tokens_to_ids(self.image_token)]

    def __call__(self, text: str, images: list[list[Any]], add_special_tokens: bool = True) -> dict:
        pictures = [p for group in images for p in group]
        out = dict(self.image_processor(images=pictures, return_tensors="np"))
        merge = self.image_processor.merge_size**2
        counts = iter(int(np.prod(g)) // merge for g in out["image_grid_thw"])
        pieces = text.split(self.image_token)
        expanded = pieces[0] + "".join(self.image_token * next(counts) + p for p in pieces[1:])
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens).input_ids
        return {"input_ids": np.asarray([ids]), **out}
