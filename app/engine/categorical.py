"""Drawing one token per row from temperature-scaled logits, with top-k, top-p and min-p.

Two ways to draw, by what a row is promised:
- an unseeded row takes an inverse-CDF lookup: one uniform u, the first token whose
  cumulative weight exceeds u times the row's total. It reads the vocabulary about three
  times (max, exp, cumsum) and needs one random number, where the exponential race below
  draws one per token: on a CPU at 32 rows of 49,152 tokens the race was most of a step;
- a seeded row, promised the same output for the same seed, takes the exponential race,
  argmax(p / E) with E ~ Exp(1) per token id from its own generator. Its winner moves
  only when two tokens' ratios nearly tie, where a lookup's moves whenever the cumulative
  sums before u shift: float32 logits that differ in the last bits (a prefix-cache hit
  computes the prompt's last token in another shape than a cold prefill) changed one of
  the three 60-token outputs of a seeded request with the lookup, none with the race.
A source of randomness is (R,) uniforms or (R, V) exponentials; `choose` tells them apart.

Top-k and top-p keep the best tokens in order: a token is dropped past rank k, or once the
tokens strictly better than it hold more than p of the mass (the best token always
stays). Equal logits (common in bfloat16) are ordered by token id, and a candidate's
probability is computed alike on either path below, so that a draw never depends on
which path, or which other rows, the batch brought. On a CPU, where sorting a vocabulary
costs ~15 softmaxes, the candidates are the best TOP_CANDIDATES tokens (a partial
selection); a row whose nucleus reaches past them (a flat distribution) takes the full
sort. On a GPU the full sort is cheap and checking the candidates' mass would need a host
read, so it always sorts.
"""

import torch

TOP_CANDIDATES = 1024  # top-p's nucleus is looked for among this many best tokens first


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(R,) the index of each row's drawn entry by inverse CDF: weights (R, N) >= 0, not
    normalised; uniforms (R,) in [0, 1). A zero weight is never drawn; a row with nothing
    to draw (all zero: every token forbidden) gets entry 0, its best candidate where rows
    are sorted, as the race's argmax does."""
    cdf = weights.cumsum(dim=-1)  # (R, N)
    total = cdf[:, -1:]  # (R, 1)
    # right=True: the first entry whose cumulative weight exceeds the target, so an entry
    # adding nothing (weight 0) is never the answer.
    index = torch.searchsorted(cdf, uniforms[:, None].to(cdf.dtype) * total, right=True)
    index = index.clamp_(max=weights.shape[-1] - 1)
    return index.masked_fill_(~(total > 0), 0)[:, 0]  # ~(>): NaN totals too


def choose(
    weights: torch.Tensor, randomness: torch.Tensor, ids: torch.Tensor | None = None
) -> torch.Tensor:
    """(R,) the index into `weights` (R, N) each row draws. `randomness`: (R,) uniforms
    (inverse CDF) or (R, V) exponentials by token id (the race); `ids` (R, N): the token
    id of each entry when `weights` are candidates, not the whole vocabulary."""
    if randomness.dim() == 1:
        return draw(weights, randomness)
    noise = randomness if ids is None else randomness.gather(1, ids)
    return (weights / noise).argmax(dim=-1)


def sample_full(
    scaled: torch.Tensor, min_p: torch.Tensor, randomness: torch.Tensor
) -> torch.Tensor:
    """Draws over the whole vocabulary: scaled (R, V) float32 logits (-inf: never),
    min_p (R,) (0: off)."""
    weights = (scaled - scaled.max(dim=-1, keepdim=True).values).exp_()  # best token: 1
    weights.masked_fill_(weights < min_p[:, None], 0.0)  # min-p is relative to the best
    return choose(weights, randomness)


def sample_top(
    scaled: torch.Tensor,  # (R, V) float32
    top_k: list[int],  # V where off
    top_p: list[float],  # 1.0 where off
    min_p: torch.Tensor,  # (R,)
    randomness: torch.Tensor,  # (R,) or (R, V)
) -> torch.Tensor:
    """Draws among each row's top-k / top-p tokens."""
    vocab = scaled.shape[-1]
    dev = scaled.device
    wanted = max(k if k < vocab else 0 for k in top_k)
    if any(p < 1.0 for p in top_p):
        wanted = max(wanted, TOP_CANDIDATES)
    if dev.type != "cpu" or wanted >= vocab:
        return _sample_sorted(scaled, top_k, top_p, min_p, randomness)
    values, ids = _by_id(*scaled.topk(wanted))  # (R, K), best first
    probs = (values - torch.logsumexp(scaled, dim=-1, keepdim=True)).exp_()  # true shares
    keep = _kept(probs, top_k, top_p, min_p)
    # The nucleus reaches past the candidates where they hold no more than p in all
    # (a p of 1 never applies: -1 marks it).
    nucleus = torch.tensor([p if p < 1.0 else -1.0 for p in top_p])
    short = (probs.sum(dim=-1) <= nucleus).nonzero()[:, 0].tolist()
    picked = ids.gather(1, choose(probs * keep, randomness, ids)[:, None])[:, 0]
    if short:
        rows = torch.tensor(short)
        ks, ps = [top_k[i] for i in short], [top_p[i] for i in short]
        picked[rows] = _sample_sorted(scaled[rows], ks, ps, min_p[rows], randomness[rows])
    return picked


def _sample_sorted(
    scaled: torch.Tensor,
    top_k: list[int],
    top_p: list[float],
    min_p: torch.Tensor,
    randomness: torch.Tensor,
) -> torch.Tensor:
    values, order = scaled.sort(dim=-1, descending=True, stable=True)  # ties: by id
    probs = (values - torch.logsumexp(scaled, dim=-1, keepdim=True)).exp_()  # (R, V)
    keep = _kept(probs, top_k, top_p, min_p)
    return order.gather(1, choose(probs * keep, randomness, order)[:, None])[:, 0]


def _by_id(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """topk's candidates, best first, equal values in token-id order (topk leaves ties in
    an order that depends on how many it was asked for)."""
    ids, order = ids.sort(dim=-1)
    values, order = values.gather(1, order).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, order)


def _kept(
    probs: torch.Tensor, top_k: list[int], top_p: list[float], min_p: torch.Tensor
) -> torch.Tensor:
    """(R, K) float 1/0: which of the best-first candidates (true probabilities) stay."""
    dev = probs.device
    rank = torch.arange(probs.shape[-1], device=dev)[None, :]
    drop = rank >= _on(torch.tensor(top_k), dev)[:, None]
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop |= before > _on(torch.tensor(top_p), dev)[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # always keep the best token
    return (~drop).to(probs.dtype)


def _on(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)
