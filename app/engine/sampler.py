"""Sampler: logits -> next tokens, one row per sequence, batched where it pays.

Order of operations (as in vLLM): raw logprobs are taken from the model's logits;
then logit_bias, min_tokens masking and penalties; then a constrained row's grammar mask
(app.engine.grammar: every token it does not allow is -inf); then greedy argmax, or temperature,
top-k, top-p, min-p and a draw. A draw is argmax(probs / E) with E ~ Exp(1), and a
seeded sequence draws E from its own generator, so its output never depends on what
else is in the batch.
"""

import logging
from dataclasses import dataclass

import torch

from app.engine.grammar import Forbidden
from app.engine.sequence import Sequence
from app.protocol.outputs import TokenLogprob

logger = logging.getLogger(__name__)

Picked = tuple[int, TokenLogprob | None] | Exception  # one row's token, or why it has none


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], seed: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The batch's generator on the logits' device (sampling runs where they are)."""
        if device not in self.generators:
            self.generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self.generators[device]

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], forbidden: Forbidden | None = None
    ) -> SampleResult:
        # logits: (S, V) in the model's dtype, on the model's device
        if all(_plain_greedy(s) for s in seqs):
            picked = _masked(logits, logits.float(), forbidden).argmax(dim=-1)
            return SampleResult(picked.tolist(), [None] * len(seqs))
        given, logits = logits, logits.float()
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = _masked(given, self._adjust(logits, seqs), forbidden)
        tokens = self._pick(logits, seqs)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for i, seq in enumerate(seqs):
                if seq.params.logprobs is not None:
                    logprobs[i] = _token_logprob(
                        raw_logprobs[i], token_list[i], seq.params.logprobs
                    )
        return SampleResult(token_list, logprobs)

    def sample_each(
        self, logits: torch.Tensor, seqs: list[Sequence], forbidden: Forbidden | None = None
    ) -> list[Picked]:
        """The batch's tokens; if sampling the batch fails, row by row, so that only the
        sequences whose rows fail get an exception (one bad request's params never end
        the others')."""
        try:
            result = self(logits, seqs, forbidden)
            return list(zip(result.token_ids, result.logprobs, strict=True))
        except Exception:
            logger.exception("sampling a batch of %d failed; sampling row by row", len(seqs))
        picked: list[Picked] = []
        for i, seq in enumerate(seqs):
            try:
                one = self(logits[i : i + 1], [seq], forbidden and forbidden.row(i))
                picked.append((one.token_ids[0], one.logprobs[0]))
            except Exception as exc:
                picked.append(exc)
        return picked

    def _adjust(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        needs = [
            i
            for i, s in enumerate(seqs)
            if s.params.logit_bias
            or s.params.needs_penalties
            or s.num_output_tokens < s.params.min_tokens
        ]
        if not needs:
            return logits
        logits = logits.clone()
        for i in needs:
            seq, row = seqs[i], logits[i]
            p = seq.params
            if p.logit_bias:
                ids = torch.tensor(
                    [t for t in p.logit_bias if t < self.vocab_size],
                    dtype=torch.long,
                    device=row.device,
                )
                vals = torch.tensor(
                    [p.logit_bias[t] for t in p.logit_bias if t < self.vocab_size],
                    device=row.device,
                )
                row.index_add_(0, ids, vals)
            if seq.num_output_tokens < p.min_tokens:
                banned = [
                    t for t in (*self.eos_token_ids, *p.stop_token_ids) if t < self.vocab_size
                ]
                row[banned] = float("-inf")
            if p.needs_penalties:
                _apply_penalties(row, seq, self.vocab_size)
        return logits

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev = logits.device
        greedy = torch.tensor([s.params.greedy for s in seqs], device=dev)
        if bool(greedy.all()):
            return logits.argmax(dim=-1)
        temps = torch.tensor(
            [s.params.temperature if not s.params.greedy else 1.0 for s in seqs], device=dev
        )
        scaled = logits / temps[:, None]
        scaled = _filter_top_k_top_p(scaled, seqs)
        probs = torch.softmax(scaled, dim=-1)
        min_ps = torch.tensor([s.params.min_p for s in seqs], device=dev)
        if bool((min_ps > 0).any()):
            top = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < min_ps[:, None] * top, 0.0)
        noise = torch.empty_like(probs).exponential_(generator=self.generator(dev))
        for i, seq in enumerate(seqs):
            if seq.generator is not None:  # a seeded request draws on the CPU, as everywhere
                row = torch.empty(probs.shape[-1]).exponential_(generator=seq.generator)
                noise[i] = row.to(dev)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)


def _masked(given: torch.Tensor, logits: torch.Tensor, forbidden: Forbidden | None) -> torch.Tensor:
    """`logits` (float32, derived from `given`) with the tokens a constrained row's grammar
    forbids at -inf; in place unless `logits` still is `given` (which a retry samples
    again)."""
    if forbidden is None:
        return logits
    if logits.data_ptr() == given.data_ptr():
        logits = logits.clone()
    forbidden.apply_(logits)
    return logits


def _plain_greedy(seq: Sequence) -> bool:
    p = seq.params
    return (
        p.greedy
        and p.logprobs is None
        and not p.logit_bias
        and not p.needs_penalties
        and seq.num_output_tokens >= p.min_tokens
    )


def _apply_penalties(row: torch.Tensor, seq: Sequence, vocab_size: int) -> None:
    p = seq.params
    out_ids = torch.tensor(seq.output_token_ids, dtype=torch.long, device=row.device)
    if p.repetition_penalty != 1.0:
        # As in transformers/vLLM: over prompt and output; shrink positive logits, grow negative.
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=row.device)
        seen = seen[seen < vocab_size]
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if len(out_ids) and (p.presence_penalty or p.frequency_penalty):
        # As in OpenAI: over generated tokens only.
        counts = torch.bincount(out_ids[out_ids < vocab_size], minlength=vocab_size).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _filter_top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs]
    ps = [s.params.top_p for s in seqs]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    dev = logits.device
    rank = torch.arange(vocab, device=dev)[None, :]
    drop = rank >= torch.tensor(ks, device=dev)[:, None]
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop |= before > torch.tensor(ps, device=dev)[:, None]
    drop[:, 0] = False  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _token_logprob(row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if num_top:
        values, ids = row.topk(num_top)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id, float(row[token_id]), top)
