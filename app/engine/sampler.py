"""Sampler: logits -> next tokens, one row per sequence, batched where it pays.

Order of operations (as in vLLM): raw logprobs are taken from the model's logits;
then logit_bias, min_tokens masking and penalties; then a constrained row's grammar mask
(app.engine.grammar: every token it does not allow is -inf); then greedy argmax, or temperature,
top-k, top-p, min-p and a draw (app.engine.categorical: an inverse-CDF lookup, or for a
seeded sequence the exponential race with noise from its own generator, so its output
never depends on what else is in the batch).
"""

import logging
from dataclasses import dataclass

import torch

from app.engine import categorical
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
        # logits: (S, V) in the model's dtype, on the model's device. Every choice below
        # is made from the sequences' params on the host, never by reading the device:
        # the only copy back is the result's (ids and the logprobs asked for), at the end.
        if all(_plain_greedy(s) for s in seqs):
            picked = _masked(logits, logits.float(), forbidden).argmax(dim=-1)
            (ids,) = to_host(picked)
            return SampleResult(ids.tolist(), [None] * len(seqs))
        given, logits = logits, logits.float()
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = _masked(given, self._adjust(logits, seqs), forbidden)
        tokens = self._pick(logits, seqs)
        if raw_logprobs is None:
            (ids,) = to_host(tokens)
            return SampleResult(ids.tolist(), [None] * len(seqs))
        return _with_logprobs(raw_logprobs, tokens, seqs)

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
        """(S,) the next tokens: greedy rows argmax, the others a draw (app.engine.categorical)."""
        drawn = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if len(drawn) < len(seqs):
            picked = logits.argmax(dim=-1)
        else:
            picked = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        if not drawn:
            return picked
        dev, vocab = logits.device, logits.shape[-1]
        params = [seqs[i].params for i in drawn]
        # One copy of the rows' settings: temperature, min_p.
        settings = _to_device(torch.tensor([(p.temperature, p.min_p) for p in params]), dev)
        rows = rows_at(drawn, len(seqs), dev)
        scaled = logits[rows] / settings[:, :1]  # (R, V)
        min_p = settings[:, 1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        choice = torch.empty(len(drawn), dtype=torch.long, device=dev)
        # Groups of rows drawn alike: whole vocabulary or top-k/top-p, seeded or not.
        for group in _groups([seqs[i] for i in drawn], top_k, vocab):
            at = rows_at(group, len(drawn), dev)
            randomness = self._randomness([seqs[drawn[j]] for j in group], vocab, dev)
            if all(top_k[j] == vocab and top_p[j] >= 1.0 for j in group):
                choice[at] = categorical.sample_full(scaled[at], min_p[at], randomness)
            else:
                ks, ps = [top_k[j] for j in group], [top_p[j] for j in group]
                choice[at] = categorical.sample_top(scaled[at], ks, ps, min_p[at], randomness)
        picked[rows] = choice
        return picked

    def _randomness(self, seqs: list[Sequence], vocab: int, dev: torch.device) -> torch.Tensor:
        """What the rows draw with (app.engine.categorical): unseeded rows one uniform
        each; seeded rows a race's exponentials over the vocabulary from their own
        generator (on the CPU, as everywhere), so that a seeded output depends on
        neither the batch nor the last bits of its logits."""
        if seqs[0].generator is None:
            return torch.rand(len(seqs), generator=self.generator(dev), device=dev)
        noise = [torch.empty(vocab).exponential_(generator=s.generator) for s in seqs]
        return _to_device(torch.stack(noise), dev)


def _groups(seqs: list[Sequence], top_k: list[int], vocab: int) -> list[list[int]]:
    """Indices of `seqs` by how they draw: (top-k/top-p or not, seeded or not); each
    group is seeded throughout or not at all."""
    groups: dict[tuple[bool, bool], list[int]] = {}
    for j, seq in enumerate(seqs):
        narrow = top_k[j] < vocab or seq.params.top_p < 1.0
        groups.setdefault((narrow, seq.generator is not None), []).append(j)
    return list(groups.values())


def rows_at(group: list[int], size: int, dev: torch.device) -> torch.Tensor | slice:
    """Index of `group` among `size` rows: a slice when it is all of them (no copy)."""
    if len(group) == size:
        return slice(None)
    return _to_device(torch.tensor(group), dev)


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors on the CPU: from a GPU, each copied into pinned memory without
    blocking, then one wait for all of them (a host sync per tensor otherwise)."""
    if all(t.device.type == "cpu" for t in tensors):
        return tensors
    copies = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
    for host, t in zip(copies, tensors, strict=True):
        host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return copies


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
    """The tokens and, for the sequences that asked, the chosen token's logprob and the
    top alternatives: gathered for all such rows at once, one copy to the host."""
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    rows = _to_device(torch.tensor(want), raw.device)
    wanted = raw[rows]  # (W, V)
    chosen = wanted.gather(1, tokens[rows, None])[:, 0]  # (W,)
    k = max(seqs[i].params.logprobs for i in want)
    if k:
        top_values, top_ids = wanted.topk(k)  # (W, k) each
    else:
        top_values = top_ids = chosen.new_empty(len(want), 0)
    ids, chosen, top_values, top_ids = to_host(tokens, chosen, top_values, top_ids)
    token_list = ids.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    chosen, top_values, top_ids = chosen.tolist(), top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(want):
        n = seqs[i].params.logprobs
        top = tuple(zip(top_ids[j][:n], top_values[j][:n], strict=True))
        logprobs[i] = TokenLogprob(token_list[i], chosen[j], top)
    return SampleResult(token_list, logprobs)


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
