"""The torch path's prefills: each sequence's span of the flat batch, and the mask of the
keys its queries see (causal, an image's tokens both ways, a sliding window), built once
per window and forward."""

from dataclasses import dataclass, field

import torch


def visible_keys(
    q_pos: torch.Tensor, length: int, window: int, both_ways: tuple[tuple[int, int], ...] = ()
) -> torch.Tensor:
    """(len(q_pos), length) bool: key j is visible to a query at position p iff j <= p or
    both are in one `both_ways` span [start, end), and, with a window, p - j < window."""
    j = torch.arange(length, device=q_pos.device)[None, :]
    seen = j <= q_pos[:, None]
    for start, end in both_ways:
        inside = (q_pos >= start) & (q_pos < end)
        seen |= inside[:, None] & (j >= start) & (j < end)
    if window > 0:
        seen &= j > q_pos[:, None] - window
    return seen


@dataclass
class PrefillSpan:
    start: int  # first query token in the flat batch
    end: int
    context_len: int
    gather_index: torch.Tensor | None  # (nkv, nblk) rows of the cache; None: no cached prefix
    device: torch.device
    both_ways: tuple[tuple[int, int], ...] = ()  # (start, end) positions: see BatchLayout
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # by window

    def mask(self, window: int) -> torch.Tensor:
        """(Lq, context_len) bool, True where a key is visible; built on first use."""
        if window not in self.masks:
            ctx = self.context_len
            q_pos = torch.arange(ctx - (self.end - self.start), ctx, device=self.device)
            self.masks[window] = visible_keys(q_pos, ctx, window, self.both_ways)
        return self.masks[window]
