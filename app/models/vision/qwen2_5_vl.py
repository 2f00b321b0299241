"""Qwen2.5-VL's image path: a vision transformer over an image's 14 x 14 patches (two
frames each: a still image is repeated), rotary positions from each patch's row and
column, attention within windows of 112 pixels but on a few full-attention layers,
RMSNorm and a SwiGLU MLP; then the merger, which folds each 2 x 2 of patches into one
row of the language model's width. Patches come in the processor's order, 2 x 2 blocks
of the merged grid row by row, and the windows regroup them; the rows go back into the
processor's order. Images of any size (multiples of 28 pixels) are served as they are.
The language model places an image's rows with 3-D rotary positions (app/engine/mrope.py)."""

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32, as the checkpoint was trained."""
    h = x.float()
    half = h.shape[-1] // 2
    turned = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    return (h * cos + turned * sin).to(x.dtype)


class VisionBlock(nn.Module):
    def __init__(self, vision: Any) -> None:
        super().__init__()
        d, inner = vision.hidden_size, vision.intermediate_size
        self.heads = vision.num_heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(d, 3 * d)
        self.attn.proj = nn.Linear(d, d)
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(d, inner), nn.Linear(d, inner)
        self.mlp.down_proj = nn.Linear(inner, d)

    def forward(self, x: torch.Tensor, spans: list[int], cos: torch.Tensor, sin: torch.Tensor):  # noqa: ANN201
        n, d = x.shape
        q, k, v = self.attn.qkv(self.norm1(x)).view(n, 3, self.heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)  # (n, heads, hd)
        out = [
            F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in parts))[0]
            for parts in zip(q.split(spans), k.split(spans), v.split(spans), strict=True)
        ]  # each window (or whole image) attends within itself, both ways
        x = x + self.attn.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(n, d))
        h = self.norm2(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class Qwen25VLVision(nn.Module):
    """Parameter names are the checkpoint's (`visual.`, under `model.` in transformers 5)."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        vision = hf_config.vision_config
        self.patch, self.merge = vision.patch_size, vision.spatial_merge_size
        self.frames, self.channels = vision.temporal_patch_size, vision.in_channels
        self.window = vision.window_size // self.merge // self.patch  # in merged rows
        self.full_layers = set(vision.fullatt_block_indexes)
        self.image_token_id = int(hf_config.image_token_id)
        head_dim = vision.hidden_size // vision.num_heads
        rope = getattr(vision, "rope_parameters", None) or {}
        self.theta, self.quarter = float(rope.get("rope_theta", 10000.0)), head_dim // 2
        self.visual = nn.Module()
        self.visual.patch_embed = nn.Module()
        kernel = (self.frames, self.patch, self.patch)
        self.visual.patch_embed.proj = nn.Conv3d(
            self.channels, vision.hidden_size, kernel, kernel, bias=False
        )
        self.visual.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(vision.depth))
        wide = vision.hidden_size * self.merge**2
        self.visual.merger = nn.Module()
        self.visual.merger.ln_q = RMSNorm(vision.hidden_size)
        self.visual.merger.mlp = nn.Sequential(
            nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, vision.out_hidden_size)
        )

    def grid(self, pixels: dict[str, Any]) -> tuple[int, int, int]:
        """The image's merged grid: frames, rows, columns of its language-model tokens."""
        t, h, w = (int(x) for x in np.asarray(pixels["image_grid_thw"]).reshape(-1)[:3])
        return t, h // self.merge, w // self.merge

    def rows(self, pixels: dict[str, Any]) -> int:
        """How many placeholder tokens an image fills; ValueError for pixels that are not
        its grid's patches."""
        values, grid = pixels.get("pixel_values"), pixels.get("image_grid_thw")
        width = self.channels * self.frames * self.patch**2
        if values is None or grid is None or np.asarray(grid).size != 3:
            raise ValueError("an image needs pixel_values and its image_grid_thw")
        t, h, w = (int(x) for x in np.asarray(grid).reshape(-1))
        if values.shape != (t * h * w, width) or h % self.merge or w % self.merge:
            raise ValueError(f"an image's pixel_values are not the {t}x{h}x{w} patches it names")
        return t * h * w // self.merge**2

    @torch.inference_mode()
    def forward(self, images: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each image's rows (merged tokens, text hidden), every image in one batch."""
        proj = self.visual.patch_embed.proj
        values = torch.cat([torch.as_tensor(p["pixel_values"]) for p in images])
        kernel = (self.channels, self.frames, self.patch, self.patch)
        x = proj(values.view(-1, *kernel).to(proj.weight.device, proj.weight.dtype))
        x = x.view(values.shape[0], -1)
        order, windows, wholes, positions, base = [], [], [], [], 0
        for pixels in images:
            t, h, w = self.grid(pixels)
            index, lengths = _windows(t, h, w, self.window)
            order.append(index + base)
            windows += lengths
            wholes.append(t * h * w * self.merge**2)
            positions.append(_patch_positions(t, h, w, self.merge))
            base += t * h * w
        unit = self.merge**2
        order_t = torch.cat(order).to(x.device)
        x = x.view(-1, unit, x.shape[-1])[order_t].reshape(x.shape)
        pos = torch.cat(positions).view(-1, unit, 2)[order_t.cpu()].reshape(-1, 2)
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.quarter, 2).float() / self.quarter)
        freqs = (pos[..., None].float() * inv_freq).flatten(1)  # (N, hd/2): rows, then cols
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :].to(x.device)
        cos, sin = emb.cos(), emb.sin()
        spans = [n * unit for n in windows]
        for i, block in enumerate(self.visual.blocks):
            x = block(x, wholes if i in self.full_layers else spans, cos, sin)
        merger = self.visual.merger
        rows = merger.mlp(merger.ln_q(x).view(-1, x.shape[-1] * unit))
        rows = rows[torch.argsort(order_t)]
        sizes = [self.rows(p) for p in images]
        # on the host: a step's rows go to every tensor-parallel shard with it
        return [part.cpu() for part in rows.split(sizes)]


def _patch_positions(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """(t*H*W, 2) each patch's (row, column), in the processor's order (2 x 2 blocks of
    the merged grid, row by row): h, w are the merged grid's."""
    rows = torch.arange(h * merge)[:, None].expand(-1, w * merge)
    cols = torch.arange(w * merge)[None, :].expand(h * merge, -1)

    def blocked(a: torch.Tensor) -> torch.Tensor:
        return a.reshape(h, merge, w, merge).transpose(1, 2).flatten()

    return torch.stack([blocked(rows), blocked(cols)], dim=-1).repeat(t, 1)


def _windows(t: int, h: int, w: int, size: int) -> tuple[torch.Tensor, list[int]]:
    """The merged tokens regrouped window by window (windows of size x size merged tokens,
    the grid's edge windows cut short), and each window's length."""
    index = torch.arange(t * h * w).reshape(t, h, w)
    pad_h, pad_w = -h % size, -w % size
    padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
    nh, nw = (h + pad_h) // size, (w + pad_w) // size
    grouped = padded.reshape(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(-1, size * size)
    lengths = (grouped >= 0).sum(-1)
    flat = grouped.flatten()
    return flat[flat >= 0], [int(n) for n in lengths if n > 0]
