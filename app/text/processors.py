"""Image processors built without transformers' processor classes, where those cannot be
made: Qwen2.5-VL's (its class checks a video processor's class, which needs torchvision
even unused) and a GGUF model's beside llama.cpp's projector file (no processor config:
its settings are the projector's metadata). Transformers' own image processors (Pillow)
still size each image and give its pixels; each placeholder becomes the tokens
transformers' processor would write for that image (`expansion`)."""

from pathlib import Path
from typing import Any

import numpy as np

PROCESSOR_CLASSES = ("Qwen2_5_VLProcessor", "Qwen2VLProcessor")


class ExpandingProcessor:
    """The surface app/text/images.py uses: `tokenizer`, `image_token` (the placeholder
    a template writes), `image_token_ids` (what the encoder's rows replace) and a call on
    one text and its images."""

    image_token: str
    image_processor: Any
    tokenizer: Any

    def expansion(self, pixels: dict[str, np.ndarray], index: int) -> str:
        raise NotImplementedError

    @property
    def image_token_ids(self) -> list[int]:
        return [self.tokenizer.convert_tokens_to_ids(self.soft_token)]

    @property
    def soft_token(self) -> str:
        return self.image_token

    def __call__(self, text: str, images: list[list[Any]], add_special_tokens: bool = True) -> dict:
        pictures = [p for group in images for p in group]
        out = dict(self.image_processor(images=pictures, return_tensors="np"))
        pieces = text.split(self.image_token)
        expanded = pieces[0] + "".join(
            self.expansion(out, i) + piece for i, piece in enumerate(pieces[1:])
        )
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens).input_ids
        return {"input_ids": np.asarray([ids]), **out}


class QwenProcessor(ExpandingProcessor):
    """Qwen2.5-VL's: one image token per merged 2 x 2 of patches. An image is scaled down
    to take at most `max_tokens` (its checkpoint's own bound, 16384 tokens, would have
    a phone's photo refused), as its `max_pixels` would."""

    around_raw_image = ("<|vision_start|>", "<|vision_end|>")  # what its template writes

    def __init__(self, image_processor: Any, tokenizer: Any, max_tokens: int) -> None:
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        token_pixels = (image_processor.patch_size * image_processor.merge_size) ** 2
        size = image_processor.size
        size.longest_edge = min(
            size.longest_edge or max_tokens * token_pixels, max_tokens * token_pixels
        )

    @classmethod
    def from_directory(cls, directory: Path, max_tokens: int) -> "QwenProcessor":
        from transformers import AutoImageProcessor, AutoTokenizer

        images = AutoImageProcessor.from_pretrained(str(directory))
        return cls(images, AutoTokenizer.from_pretrained(str(directory)), max_tokens)

    @classmethod
    def from_projector(
        cls, meta: dict[str, Any], tokenizer: Any, max_tokens: int
    ) -> "QwenProcessor":
        """For a GGUF model and its projector file: Qwen's image processor with the
        projector's patch, merge, mean and std (else CLIP's, Qwen's own), and llama.cpp's
        bounds of 8 to 4096 tokens an image (at most `max_tokens`)."""
        from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        patch = int(meta["clip.vision.patch_size"])
        merge = int(meta.get("clip.vision.spatial_merge_size") or 2)
        token_pixels = (patch * merge) ** 2
        images = Qwen2VLImageProcessorPil(
            size={
                "shortest_edge": min(8, max_tokens) * token_pixels,
                "longest_edge": 4096 * token_pixels,
            },
            patch_size=patch,
            merge_size=merge,
            temporal_patch_size=2,
            image_mean=list(meta.get("clip.vision.image_mean", OPENAI_CLIP_MEAN)),
            image_std=list(meta.get("clip.vision.image_std", OPENAI_CLIP_STD)),
        )
        return cls(images, tokenizer, max_tokens)

    def expansion(self, pixels: dict[str, np.ndarray], index: int) -> str:
        merge = self.image_processor.merge_size**2
        return self.image_token * (int(np.prod(pixels["image_grid_thw"][index])) // merge)


class Gemma3ProjectorProcessor(ExpandingProcessor):
    """Gemma 3's, for a GGUF model and its projector file: the projector's image size,
    mean and std in Gemma 3's image processor; `<start_of_image>` becomes Gemma 3's
    sequence (`Gemma3Processor.full_image_sequence`)."""

    image_token = "<start_of_image>"
    soft_token = "<image_soft_token>"

    def __init__(self, tokenizer: Any, meta: dict[str, Any], tokens_per_image: int) -> None:
        from transformers.models.gemma3.image_processing_pil_gemma3 import (
            Gemma3ImageProcessorPil,
        )

        side = int(meta["clip.vision.image_size"])
        self.image_processor = Gemma3ImageProcessorPil(
            size={"height": side, "width": side},
            image_mean=list(meta.get("clip.vision.image_mean", [0.5] * 3)),
            image_std=list(meta.get("clip.vision.image_std", [0.5] * 3)),
        )
        self.tokenizer = tokenizer
        soft = self.soft_token * tokens_per_image
        self.sequence = f"\n\n<start_of_image>{soft}<end_of_image>\n\n"

    def expansion(self, pixels: dict[str, np.ndarray], index: int) -> str:
        return self.sequence


def projector_processor(path: str, model: str, tokenizer: Any, max_tokens: int) -> Any:
    """The image processor of a GGUF model beside llama.cpp's projector file at `path`,
    over the model's `tokenizer`: Gemma 3's or Qwen's as above, or transformers' own
    Idefics3 processor (its class needs no video processor) with the projector's sizes."""
    from app.models.vision.mmproj import model_config, read_mmproj
    from app.models.vision.mmproj_qwen import KIND as QWEN

    kind, meta, _ = read_mmproj(path, model)
    config = model_config(kind, meta, 0, model)
    if kind == QWEN:
        return QwenProcessor.from_projector(meta, tokenizer, max_tokens)
    if kind == "gemma3":
        return Gemma3ProjectorProcessor(tokenizer, meta, config.mm_tokens_per_image)
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    vision = config.vision_config
    longest = int(meta.get("clip.vision.preproc_image_size") or vision.image_size)
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": longest},
        max_image_size={"longest_edge": vision.image_size},
        image_mean=list(meta.get("clip.vision.image_mean", [0.5] * 3)),
        image_std=list(meta.get("clip.vision.image_std", [0.5] * 3)),
        do_image_splitting=True,
    )
    rows = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=rows)
