"""Idefics3's image path (SmolVLM): a SigLIP encoder over each image's tiles, then the
connector: a pixel shuffle that folds each 2x2 (scale_factor) of patches into one row,
projected to the language model's width. A tile of 1024 patches becomes 64 rows, one per
`<image>` token the processor put in the prompt."""

from typing import Any

import numpy as np
import torch
from torch import nn

from app.models.families import idefics3 as family
from app.models.vision.siglip import SiglipVisionModel

ARCHITECTURES = tuple(family.ARCHITECTURES)  # the checkpoints this encoder is part of


class Connector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, scale_factor: int) -> None:
        super().__init__()
        self.scale = scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(
            vision_hidden * scale_factor**2, text_hidden, bias=False
        )

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """(B, side * side, d) -> (B, side * side / s^2, d * s^2), in the checkpoint's
        order: rows of s patches, then s such rows, interleaved as it was trained."""
        b, n, d = x.shape
        s, side = self.scale, int(n**0.5)
        x = x.view(b, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(b, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return x.reshape(b, n // (s * s), d * s * s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(self.pixel_shuffle(x))


class Idefics3Vision(nn.Module):
    """Parameter names are the checkpoint's under `model.`."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        vision, text = hf_config.vision_config, hf_config.text_config
        self.vision_model = SiglipVisionModel(vision)
        self.connector = Connector(vision.hidden_size, text.hidden_size, hf_config.scale_factor)
        self.image_token_id = int(hf_config.image_token_id)
        self.tile = (vision.num_channels, vision.image_size, vision.image_size)
        per_side = vision.image_size // vision.patch_size
        self.rows_per_tile = per_side**2 // hf_config.scale_factor**2

    def rows(self, pixels: dict[str, Any]) -> int:
        """How many placeholder tokens an image's processed pixels fill; ValueError for
        pixels not in this encoder's tiles (the connector needs square ones)."""
        values, mask = pixels.get("pixel_values"), pixels.get("pixel_attention_mask")
        if values is None or values.ndim < 4 or tuple(values.shape[-3:]) != self.tile:
            raise ValueError(f"an image's pixel_values are not tiles of {self.tile}")
        if mask is not None and tuple(mask.shape) != tuple(values.shape[:-3] + values.shape[-2:]):
            raise ValueError("an image's pixel_attention_mask does not match its pixels")
        return int(np.prod(values.shape[:-3])) * self.rows_per_tile

    @torch.inference_mode()
    def forward(self, images: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each image's rows (tiles x rows_per_tile, text hidden), the tiles of images
        alike in size run as one batch."""
        tiles = []
        for pixels in images:
            values = torch.as_tensor(pixels["pixel_values"]).flatten(0, -4)  # (tiles, C, H, W)
            mask = pixels.get("pixel_attention_mask")
            if mask is None:
                mask = torch.ones(values.shape[0], *values.shape[-2:], dtype=torch.bool)
            tiles.append((values, torch.as_tensor(mask).flatten(0, -3).bool()))
        weight = self.connector.modality_projection.proj.weight
        dtype, device = weight.dtype, weight.device
        out: list[torch.Tensor | None] = [None] * len(images)
        for shape in dict.fromkeys(v.shape[1:] for v, _ in tiles):
            same = [i for i, (v, _) in enumerate(tiles) if v.shape[1:] == shape]
            values = torch.cat([tiles[i][0] for i in same]).to(device, dtype)
            masks = torch.cat([tiles[i][1] for i in same]).to(device)
            rows = self.connector(self.vision_model(values, masks))
            for i, part in zip(same, rows.split([len(tiles[i][0]) for i in same]), strict=True):
                # on the host: a step's rows go to every tensor-parallel shard with it
                out[i] = part.reshape(-1, part.shape[-1]).cpu()
        return out  # type: ignore[return-value]
