"""Speculative decoding by prompt lookup (n-gram): a greedy sequence whose last tokens
appeared earlier in its own tokens (a summary quoting its source, an edit copying code)
is proposed the tokens that followed them there. The step computes the sequence's last
token and the proposal as one chunk, with logits at each of them; the model's own greedy
pick at each position accepts the proposal up to its first miss, and the pick there (or
after the whole proposal) is one more token. So a step yields 1 to k + 1 tokens, each
the token plain decoding would have picked after the same prefix.

Only plain greedy sequences speculate (no logprobs, penalties, bias, grammar, forks,
contexts); the rest decode as before, in the same batch. Speculation runs only while at
most `max_running` sequences run: a batch that is already large fills the machine, and
verifying proposals would cost more tokens of compute than it saves steps."""

from dataclasses import dataclass

import numpy as np
import torch

from app.engine.config import SpeculativeConfig
from app.engine.sequence import Sequence


@dataclass
class SpeculationCounts:
    proposals: int = 0  # sequence-steps that carried a proposal
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # of which accepted


class PromptLookup:
    def __init__(self, num_tokens: int, max_ngram: int, min_ngram: int, max_running: int) -> None:
        self.num_tokens, self.max_running = num_tokens, max_running
        self.ngrams = range(max_ngram, min_ngram - 1, -1)  # longest match first
        self.counts = SpeculationCounts()

    @classmethod
    def of(cls, config: SpeculativeConfig | None) -> "PromptLookup | None":
        if config is None:
            return None
        return cls(config.num_tokens, config.max_ngram, config.min_ngram, config.max_running)

    def propose(self, seq: Sequence, room: int, num_running: int, max_model_len: int) -> list[int]:
        """Up to `num_tokens` tokens to verify after `seq`'s last, within `room` more
        tokens this step; [] when `seq` should decode plainly."""
        if num_running > self.max_running or not eligible(seq):
            return []
        p = seq.params
        limit = min(
            self.num_tokens,
            room,
            p.max_tokens - seq.num_output_tokens - 1,  # the last pick is the step's own
            max_model_len - seq.num_tokens - 1,
        )
        if limit <= 0:
            return []
        return lookup(seq.token_ids, self.ngrams, limit)

    def record(self, proposed: int, accepted: int) -> None:
        self.counts.proposals += 1
        self.counts.draft_tokens += proposed
        self.counts.accepted_tokens += accepted


def eligible(seq: Sequence) -> bool:
    p = seq.params
    return (
        p.greedy
        and p.n == 1
        and p.logprobs is None
        and not p.logit_bias
        and not p.needs_penalties
        and seq.num_output_tokens >= p.min_tokens
        and seq.matcher is None
        and seq.context is None
        and seq.num_computed_tokens == seq.num_tokens - 1  # decoding, its prompt computed
    )


def lookup(tokens: list[int], ngrams: range, limit: int) -> list[int]:
    """The `limit` tokens after the latest earlier occurrence of `tokens`' last n tokens,
    for the longest n in `ngrams` that has one; [] if none has."""
    length = len(tokens)
    if length < 2:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in ngrams:
        if length <= n:
            continue
        tail = arr[length - n :]
        # starts i < length - n of windows equal to the tail (each followed by a token)
        hits = arr[: length - n] == tail[0]
        for j in range(1, n):
            hits &= arr[j : length - n + j] == tail[j]
        found = np.flatnonzero(hits)
        if found.size:
            start = int(found[-1]) + n
            return arr[start : start + limit].tolist()
    return []


def accepted_prefix(draft: list[int], picks: list[int]) -> int:
    """How many of `draft` the model's picks (one per position, len(draft) + 1) accept."""
    for i, token in enumerate(draft):
        if picks[i] != token:
            return i
    return len(draft)


def split_verified(
    logits: torch.Tensor, sampled: list[Sequence]
) -> tuple[torch.Tensor, list[Sequence], list[tuple[Sequence, list[int]]]]:
    """The step's logits rows split: (the rows and sequences sampled as usual, and each
    sequence that carried a proposal with its greedy picks, one per position)."""
    keep_rows: list[int] = []
    keep: list[Sequence] = []
    spans: list[tuple[Sequence, int, int]] = []
    row = 0
    for seq in sampled:
        width = 1 + len(seq.draft)
        if seq.draft:
            spans.append((seq, row, row + width))
        else:
            keep_rows.append(row)
            keep.append(seq)
        row += width
    picked = logits[torch.cat([torch.arange(a, b) for _, a, b in spans])]
    picks = picked.argmax(dim=-1).tolist()  # as the sampler's greedy rows
    verified, at = [], 0
    for seq, a, b in spans:
        verified.append((seq, picks[at : at + b - a]))
        at += b - a
    return logits[keep_rows], keep, verified
