"""Gemma 3's image path: SigLIP over the image at the trained size (896 x 896: 64 x 64
patches), then the projector: patches averaged in squares down to mm_tokens_per_image
(256: 16 x 16), RMS-normed with Gemma's (1 + w) and projected to the language model's
width; one row per `<image_soft_token>` of the prompt. The language model attends to an
image's tokens both ways (app/engine/images.py marks their span)."""

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from app.models.vision.siglip import SiglipVisionModel

ARCHITECTURES = ("Gemma3ForConditionalGeneration",)


class Projector(nn.Module):
    def __init__(self, vision: Any, text_hidden: int, tokens: int) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, text_hidden))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(vision.hidden_size))
        self.eps = vision.layer_norm_eps
        self.per_side = vision.image_size // vision.patch_size
        self.kernel = self.per_side // int(tokens**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        grid = x.transpose(1, 2).reshape(b, d, self.per_side, self.per_side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)
        h = pooled.float()  # Gemma's RMSNorm: in float32, scaled by (1 + w)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = (h * (1.0 + self.mm_soft_emb_norm.weight.float())).to(x.dtype)
        return torch.matmul(h, self.mm_input_projection_weight)


class Gemma3Vision(nn.Module):
    """Parameter names are the checkpoint's (under `model.` in transformers 5's layout)."""

    bidirectional = True  # the decoder attends to an image's tokens both ways

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        vision, text = hf_config.vision_config, hf_config.text_config
        self.vision_tower = nn.Module()
        self.vision_tower.vision_model = SiglipVisionModel(vision)
        tokens = int(hf_config.mm_tokens_per_image)
        self.multi_modal_projector = Projector(vision, text.hidden_size, tokens)
        self.image_token_id = int(hf_config.image_token_id)
        self.tile = (vision.num_channels, vision.image_size, vision.image_size)
        self.rows_per_tile = tokens

    def rows(self, pixels: dict[str, Any]) -> int:
        """How many placeholder tokens an image's pixels fill; ValueError for pixels not
        of the trained size, or cut into pan-and-scan crops."""
        values = pixels.get("pixel_values")
        if values is None or values.ndim < 4 or tuple(values.shape[-3:]) != self.tile:
            raise ValueError(f"an image's pixel_values are not images of {self.tile}")
        if int(np.prod(values.shape[:-3])) != 1:  # each crop would need its own span
            raise ValueError("pan-and-scan crops are not served: one view of each image")
        return self.rows_per_tile

    @torch.inference_mode()
    def forward(self, images: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each image's rows (crops x mm_tokens_per_image, text hidden), all in one batch."""
        weight = self.multi_modal_projector.mm_input_projection_weight
        values = [torch.as_tensor(p["pixel_values"]).flatten(0, -4) for p in images]
        batch = torch.cat(values).to(weight.device, weight.dtype)
        rows = self.multi_modal_projector(self.vision_tower.vision_model(batch, None))
        parts = rows.split([len(v) for v in values])
        # on the host: a step's rows go to every tensor-parallel shard with it
        return [part.reshape(-1, part.shape[-1]).cpu() for part in parts]
