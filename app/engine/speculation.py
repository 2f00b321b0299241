"""Speculative decoding by prompt lookup (n-gram): a sequence whose last tokens appeared
earlier in its own tokens (a summary quoting its source, an edit copying code) is
proposed the tokens that followed them there. The step computes the sequence's last
token and the proposal as one chunk, with logits at each of them; the sampler picks at
each position as it would for plain decoding, the proposal is accepted up to its first
position whose pick differs, and the pick there (or after the whole proposal) is one
more token. So a step yields 1 to k + 1 tokens.

Greedy, the picks are plain decoding's. Sampled, this is speculative sampling's rule
for a proposal that is one token for sure (a point mass q): accept the proposed d with
probability min(1, p(d) / q(d)) = p(d), else draw from the residual max(0, p - q),
which is p without d, renormalised. Drawing x ~ p and accepting iff x == d does both at
once: d comes out with probability p(d), any other y with p(y). So the output has plain
decoding's distribution, position after position.

Only plain sequences speculate: greedy or unseeded (a seeded draw must not depend on
whether the batch let it speculate), without logprobs, penalties, bias, grammar, forks
or contexts; the rest decode as before, in the same batch. Speculation runs only while at
most `max_running` sequences run: a batch that is already large fills the machine, and
verifying proposals would cost more tokens of compute than it saves steps."""

from collections.abc import Callable
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
    def __init__(
        self, num_tokens: int, max_ngram: int, min_ngram: int, max_running: int, vocab_size: int
    ) -> None:
        self.num_tokens, self.max_running = num_tokens, max_running
        self.ngrams = range(max_ngram, min_ngram - 1, -1)  # longest match first
        self.vocab_size = vocab_size
        self.counts = SpeculationCounts()

    @classmethod
    def of(cls, config: SpeculativeConfig | None, vocab_size: int) -> "PromptLookup | None":
        if config is None:
            return None
        c = config
        return cls(c.num_tokens, c.max_ngram, c.min_ngram, c.max_running, vocab_size)

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
        draft = lookup(seq.token_ids, self.ngrams, limit)
        # An image's placeholders stand in the tokens as ids past the vocabulary
        # (app.engine.images): a proposal stops before one.
        cut = next((i for i, t in enumerate(draft) if t >= self.vocab_size), len(draft))
        return draft[:cut]

    def record(self, proposed: int, accepted: int) -> None:
        self.counts.proposals += 1
        self.counts.draft_tokens += proposed
        self.counts.accepted_tokens += accepted


def eligible(seq: Sequence) -> bool:
    p = seq.params
    return (
        (p.greedy or seq.generator is None)  # a seeded draw must not depend on the batch
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
    """How many of `draft` the sampler's picks (one per position, len(draft) + 1) accept."""
    for i, token in enumerate(draft):
        if picks[i] != token:
            return i
    return len(draft)


def split_verified(
    logits: torch.Tensor, sampled: list[Sequence], sample_each: Callable[..., list]
) -> tuple[torch.Tensor, list[Sequence], list[tuple[Sequence, list[int] | Exception]]]:
    """The step's logits rows split: (the rows and sequences sampled as usual, and each
    sequence that carried a proposal with its picks, one per position, as the sampler
    picks for it (`sample_each(rows, seqs)`); an exception where sampling it failed)."""
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
    rows = logits[torch.cat([torch.arange(a, b) for _, a, b in spans])]
    picks = sample_each(rows, [seq for seq, a, b in spans for _ in range(b - a)])
    verified: list[tuple[Sequence, list[int] | Exception]] = []
    at = 0
    for seq, a, b in spans:
        mine = picks[at : at + b - a]
        failed = next((p for p in mine if isinstance(p, Exception)), None)
        verified.append((seq, failed or [token for token, _ in mine]))
        at += b - a
    return logits[keep_rows], keep, verified
