"""The SigLIP vision transformer: over the trained grid of patches (Gemma 3's), or as
Idefics3 (SmolVLM) varies it: patches of any grid up to the trained one (NaViT's "Patch
n' Pack"), each given the position of its fractional place in the image, padded patches
masked out of attention as keys."""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SiglipAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class SiglipMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.approximate = "tanh" if act in ("gelu_pytorch_tanh", "gelu_new") else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class SiglipLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(d, eps=eps)
        self.self_attn = SiglipAttention(d, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(d, eps=eps)
        self.mlp = SiglipMLP(d, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.per_side = config.image_size // config.patch_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, config.patch_size
        )
        self.position_embedding = nn.Embedding(self.per_side**2, config.hidden_size)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor | None) -> torch.Tensor:
        """pixels (B, C, H, W); patch_mask (B, H/p, W/p), True where a patch is image, or
        None: the trained grid, whole, each patch at its place in the table."""
        b = pixels.shape[0]
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        if patch_mask is None:
            return x + self.position_embedding.weight[: x.shape[1]]
        # A patch's position is the bucket of its fractional coordinates among the trained
        # grid's, so a smaller image spreads over the whole table rather than its corner.
        device = patch_mask.device
        boundaries = torch.arange(1 / self.per_side, 1.0, 1 / self.per_side, device=device)
        rows, cols = patch_mask[:, :, 0].sum(1), patch_mask[:, 0, :].sum(1)

        def buckets(count: torch.Tensor, size: int) -> torch.Tensor:
            steps = torch.arange(size, dtype=torch.float32, device=device)
            fraction = steps[None, :] * (1.0 / count)[:, None]
            return torch.bucketize(fraction.clamp(max=1.0 - 1e-6), boundaries, right=True)

        h, w = buckets(rows, patch_mask.shape[1]), buckets(cols, patch_mask.shape[2])
        ids = (h[:, :, None] * self.per_side + w[:, None, :]).reshape(b, -1)
        ids = torch.where(patch_mask.view(b, -1), ids, torch.zeros_like(ids))
        return x + self.position_embedding(ids)


class SiglipVisionModel(nn.Module):
    """Its parameters carry the checkpoint's names under `vision_model.`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            SiglipLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, pixel_mask: torch.Tensor | None) -> torch.Tensor:
        """pixels (B, C, H, W) and pixel_mask (B, H, W), or None for images of the trained
        size: (B, patches, hidden)."""
        p, mask = self.embeddings.patch_size, None
        if pixel_mask is None:
            x = self.embeddings(pixels, None)
        else:
            grid = pixel_mask.unfold(1, p, p).unfold(2, p, p)
            patch_mask = grid.sum(dim=(-1, -2)) > 0
            x = self.embeddings(pixels, patch_mask)
            keys = patch_mask.view(pixels.shape[0], 1, 1, -1)
            mask = None if bool(keys.all()) else keys  # padded patches are no one's keys
        for layer in self.encoder.layers:
            x = layer(x, mask)
        return self.post_layernorm(x)
