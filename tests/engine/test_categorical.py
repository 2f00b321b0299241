"""Token draws (app.engine.categorical): each kept token comes out as often as its share
of the kept mass, dropped ones never, on both of top-p's paths (the best candidates, and
the full sort a flat row needs)."""

import pytest
import torch

from app.engine import categorical

DRAWS = 20_000


def frequencies(picks: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(picks, minlength=vocab).double() / picks.numel()


def rows_of(probs: list[float], vocab: int | None = None) -> torch.Tensor:
    """DRAWS identical rows of log-probabilities: `probs` first, the rest -inf."""
    row = torch.full((vocab or len(probs),), float("-inf"))
    row[: len(probs)] = torch.tensor(probs).log()
    return row.expand(DRAWS, -1).contiguous()


def uniforms(seed: int = 0) -> torch.Tensor:
    return torch.rand(DRAWS, generator=torch.Generator().manual_seed(seed))


def test_draw_follows_the_weights_and_skips_zeros():
    weights = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0]).expand(DRAWS, -1)
    f = frequencies(categorical.draw(weights, uniforms()), 5)
    assert f[0] == f[2] == 0
    assert f[1:].tolist() == pytest.approx([0.0, 0.5, 0.0, 0.25, 0.25][1:], abs=0.01)
    # the extremes of [0, 1) land on real tokens
    edge = categorical.draw(weights[:2], torch.tensor([0.0, 1.0 - 1e-7]))
    assert edge.tolist() == [1, 4]


def test_sample_full_is_the_softmax_with_min_p():
    probs = [0.5, 0.3, 0.15, 0.05]
    scaled = rows_of(probs)
    off = torch.zeros(DRAWS)
    f = frequencies(categorical.sample_full(scaled, off, uniforms()), 4)
    assert f.tolist() == pytest.approx(probs, abs=0.01)
    # min_p 0.2: tokens under 0.2 x the best (0.1) are dropped
    f = frequencies(categorical.sample_full(scaled, off + 0.2, uniforms(1)), 4)
    assert f[3] == 0 and f[:3].tolist() == pytest.approx(
        [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95], abs=0.01
    )


@pytest.mark.parametrize("vocab", [4, 1500])  # the full sort; the best candidates
def test_top_p_keeps_the_nucleus(vocab):
    probs = [0.5, 0.3, 0.15, 0.05]
    if vocab > 4:  # the rest of the mass spread thin over the tail
        probs = [p * 0.99 for p in probs] + [0.01 / (vocab - 4)] * (vocab - 4)
    scaled = rows_of(probs)
    picks = categorical.sample_top(
        scaled, [vocab] * DRAWS, [0.7] * DRAWS, torch.zeros(DRAWS), uniforms()
    )
    f = frequencies(picks, vocab)
    # strictly better mass: 0, 0.5, 0.8 -> the third token on is dropped
    assert f[2:].sum() == 0
    assert f[:2].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8], abs=0.01)


def test_top_k_and_min_p_together():
    probs = [0.4, 0.3, 0.2, 0.1]
    picks = categorical.sample_top(
        rows_of(probs), [3] * DRAWS, [1.0] * DRAWS, torch.full((DRAWS,), 0.6), uniforms()
    )
    f = frequencies(picks, 4)
    # top-3 keeps 0.4, 0.3, 0.2; min_p 0.6 x 0.4 = 0.24 drops 0.2
    assert f[2:].sum() == 0 and f[:2].tolist() == pytest.approx([4 / 7, 3 / 7], abs=0.01)


def test_a_flat_row_takes_the_full_sort():
    """Top-p of 0.9 over 1,500 equal tokens keeps 1,350: past the 1,024 candidates."""
    vocab = 1500
    scaled = torch.zeros(DRAWS, vocab)
    picks = categorical.sample_top(
        scaled, [vocab] * DRAWS, [0.9] * DRAWS, torch.zeros(DRAWS), uniforms()
    )
    kept = torch.bincount(picks, minlength=vocab) > 0
    assert 1300 < int(kept.sum()) <= 1351  # more than the candidates hold
    assert categorical.TOP_CANDIDATES < 1300


def test_top_k_one_is_greedy():
    scaled = torch.randn(64, 500)
    picks = categorical.sample_top(scaled, [1] * 64, [1.0] * 64, torch.zeros(64), torch.rand(64))
    assert picks.tolist() == scaled.argmax(dim=-1).tolist()


@pytest.mark.parametrize("vocab", [1000, 5000])  # the other row brings the full sort; 1,024
def test_a_rows_draw_ignores_the_other_rows(vocab):
    """bfloat16 logits tie often: equal ones go in token-id order, and a candidate's
    probability is computed alike on both paths, so a top-k row draws the same token
    whatever else shares its batch (a seeded request's promise)."""
    g = torch.Generator().manual_seed(1)
    rows = (torch.randn(300, vocab, generator=g) * 3).bfloat16().float()
    u = torch.rand(300, generator=g)
    alone = categorical.sample_top(rows, [40] * 300, [1.0] * 300, torch.zeros(300), u)
    other = torch.randn(1, vocab, generator=g)
    mixed = categorical.sample_top(
        torch.cat([rows, other]),
        [40] * 300 + [vocab],
        [1.0] * 300 + [0.9],
        torch.zeros(301),
        torch.cat([u, torch.rand(1, generator=g)]),
    )
    assert mixed[:300].tolist() == alone.tolist()


def test_a_row_with_nothing_to_draw_gets_its_best_candidate():
    nothing = torch.full((2, 50), float("-inf"))
    assert categorical.sample_full(nothing, torch.zeros(2), torch.rand(2)).tolist() == [0, 0]
    assert categorical.draw(torch.zeros(1, 5), torch.rand(1)).tolist() == [0]
    assert categorical.draw(torch.full((1, 5), float("nan")), torch.rand(1)).tolist() == [0]


def test_the_race_follows_the_same_distribution():
    """Seeded rows draw by the exponential race, noise per token id."""
    probs = [0.5, 0.3, 0.15, 0.05]
    noise = torch.empty(DRAWS, 4).exponential_(generator=torch.Generator().manual_seed(3))
    f = frequencies(categorical.sample_full(rows_of(probs), torch.zeros(DRAWS), noise), 4)
    assert f.tolist() == pytest.approx(probs, abs=0.01)
    vocab = 1500  # candidates, then the whole sort with a p that reaches past them
    tail = [0.01 / (vocab - 4)] * (vocab - 4)
    scaled = rows_of([p * 0.99 for p in probs] + tail)
    noise = torch.empty(DRAWS, vocab).exponential_(generator=torch.Generator().manual_seed(4))
    for p, kept in ((0.7, [0.5 / 0.8, 0.3 / 0.8]), (0.999, None)):
        picks = categorical.sample_top(
            scaled, [vocab] * DRAWS, [p] * DRAWS, torch.zeros(DRAWS), noise
        )
        f = frequencies(picks, vocab)
        if kept:
            assert f[2:].sum() == 0 and f[:2].tolist() == pytest.approx(kept, abs=0.01)
        else:
            assert f[:4].tolist() == pytest.approx([p * 0.99 for p in probs], abs=0.01)


def test_the_race_ignores_the_last_bits_of_the_logits():
    """What a seeded request relies on: logits a few ulps apart (a prefix-cache hit, a
    batch of another shape) leave the race's winner where it was (the lookup moved one
    of these 2,000 rows)."""
    g = torch.Generator().manual_seed(5)
    scaled = torch.randn(2000, 2000, generator=g) * 2
    nudged = scaled * (1 + 1e-6 * torch.randn(scaled.shape, generator=g))
    noise = torch.empty(scaled.shape).exponential_(generator=g)
    off = torch.zeros(2000)
    same = categorical.sample_full(scaled, off, noise) == categorical.sample_full(
        nudged, off, noise
    )
    assert bool(same.all())
