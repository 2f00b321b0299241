"""A step's adapters three ways (app/models/lora_batch.py): per run of rows, stacked over
views of the rows, stacked over gathered rows with padding. In bfloat16, where a second
rounding would show, all three give the same bits; a padding row writes nothing."""

import numpy as np
import torch

from app.models.lora import LoraAdapter
from app.models.lora_batch import MIN_ROWS, LoraBatch, StackedLoras

DT = torch.bfloat16


def adapter(seed: int, dtype: torch.dtype = DT) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    parts = ((0, 0, 8, rand(8, 64)), (64, 8, 16, rand(8, 32)), (96, 16, 24, rand(8, 32)))
    return LoraAdapter(f"a{seed}", 8, ({"qkv": (rand(64, 24), parts)},))


def stacked_batch(adapters, rows: dict, total: int, least: int = 1) -> LoraBatch:  # noqa: ANN001
    """As app.engine.adapters.StepAdapters builds it (`least`: its MIN_ROWS)."""
    stack = StackedLoras.of(sorted(adapters, key=lambda a: a.uid))
    widest = max(least, *(len(r) for r in rows.values()))
    gather = np.full((len(stack.uids), widest), total)
    for i, uid in enumerate(stack.uids):
        gather[i, : len(rows[uid])] = rows[uid]
    flat = gather.ravel()
    if len(flat) == total and (flat == np.arange(total)).all():
        return LoraBatch((), stack)
    places = np.flatnonzero(flat != total)
    real = (torch.from_numpy(places), torch.from_numpy(flat[places]))
    return LoraBatch((), stack, torch.from_numpy(flat), real)


def test_runs_views_and_gathers_agree_to_the_bit():
    a = [adapter(i) for i in range(3)]
    x = torch.randn(17, 64).to(DT)
    base = torch.randn(17, 128).to(DT)
    # uneven, with two base rows first: the gathered way
    runs = ((a[0], 2, 7), (a[1], 7, 10), (a[2], 10, 17))
    spans = {a[0].uid: range(2, 7), a[1].uid: range(7, 10), a[2].uid: range(10, 17)}
    expected = LoraBatch(runs).add_(base.clone(), x, 0, "qkv")
    gathered = stacked_batch(a, {u: list(r) for u, r in spans.items()}, 17)
    assert gathered.gather is not None
    got = gathered.add_(base.clone(), x, 0, "qkv")
    assert torch.equal(got, expected)
    assert torch.equal(got[:2], base[:2])  # base rows, and padding, untouched
    # the stacked adapters' rows alone, in order, as many each: views
    x, base = x[2:14], base[2:14]
    order = sorted(a, key=lambda ad: ad.uid)
    runs = tuple((ad, 4 * i, 4 * i + 4) for i, ad in enumerate(order))
    expected = LoraBatch(runs).add_(base.clone(), x, 0, "qkv")
    viewed = stacked_batch(
        a, {ad.uid: list(range(4 * i, 4 * i + 4)) for i, ad in enumerate(order)}, 12
    )
    assert viewed.gather is None
    assert torch.equal(viewed.add_(base.clone(), x, 0, "qkv"), expected)


def test_a_row_gets_the_same_bits_however_many_rows_share_its_step():
    """Both ways pad to MIN_ROWS: BLAS's kernels for a few rows sum otherwise, and a
    quantized base's int8 activations would turn that ulp into another token."""
    a = [adapter(i, torch.float32) for i in range(2)]
    x, base = torch.randn(64, 64), torch.randn(64, 128)
    alone = LoraBatch(((a[0], 0, 64),)).add_(base.clone(), x, 0, "qkv")
    for m in range(1, 24):
        got = LoraBatch(((a[0], 64 - m, 64),)).add_(base.clone(), x, 0, "qkv")
        assert torch.equal(got[64 - m :], alone[64 - m :]), m
        # stacked: each adapter's block of m rows (gathered to MIN_ROWS)
        rows = {a[0].uid: list(range(64 - m, 64)), a[1].uid: list(range(m))}
        both = stacked_batch(a, rows, 64, MIN_ROWS).add_(base.clone(), x, 0, "qkv")
        assert torch.equal(both[64 - m :], alone[64 - m :]), m
