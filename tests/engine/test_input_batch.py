"""InputBatch (the persistent batch) gives every step the inputs that rebuilding them from
the sequences would: random scheduler runs with preemption, chunked prefill, prefix-cache
hits, n > 1 forks (copy-on-write), aborts between steps and rows reused, compared step
by step with a reference built from scratch."""

import random

from app.engine.block_manager import BlockManager
from app.engine.input_batch import InputBatch
from app.engine.scheduler import ScheduledBatch, Scheduler
from app.engine.sequence import Sequence
from app.protocol import SamplingParams
from app.protocol.outputs import FinishReason


def rebuilt(batch: ScheduledBatch, bs: int) -> dict:
    """The step's inputs from the sequences alone, token by token (decodes first)."""
    order = sorted(range(len(batch)), key=lambda i: batch.num_new_tokens[i] != 1)
    want: dict = {k: [] for k in ("ids", "positions", "slots", "queries", "contexts")}
    want |= {"tables": [], "logits_rows": [], "sampled": []}
    for i in order:
        seq, n = batch.seqs[i], batch.num_new_tokens[i]
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        want["ids"] += seq.token_ids[start:end]
        want["positions"] += range(start, end)
        table = seq.block_table
        want["slots"] += [table[p // bs] * bs + p % bs for p in range(start, end)]
        want["queries"].append(n)
        want["contexts"].append(end)
        want["tables"].append(table[: -(-end // bs)])
        if end == seq.num_tokens:
            want["logits_rows"].append(len(want["ids"]) - 1)
            want["sampled"].append(seq)
    return want


def check(inputs, sampled, want: dict) -> None:
    layout = inputs.layout
    assert inputs.input_ids.tolist() == want["ids"]
    assert inputs.positions.tolist() == want["positions"]
    assert layout.slot_mapping.tolist() == want["slots"]
    assert layout.query_lens == want["queries"] and layout.context_lens == want["contexts"]
    assert layout.num_decodes == sum(1 for n in want["queries"] if n == 1)
    for row, table in zip(layout.block_tables.tolist(), want["tables"], strict=True):
        assert row[: len(table)] == table
    assert inputs.logits_rows.tolist() == want["logits_rows"]
    assert sampled == want["sampled"]


def simulate(seed: int) -> tuple[int, int]:
    """One random run; returns (preemptions, copies-on-write) so the test can say the
    runs took those paths."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 16])
    bm = BlockManager(rng.randint(6, 40), bs, enable_prefix_caching=rng.random() < 0.7)
    scheduler = Scheduler(
        bm,
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(4, 40),
        max_model_len=64,
        eos_token_ids=(0,),
    )
    inputs = InputBatch(2, 64, bs)  # fewer rows than sequences: rows are added
    families: dict[str, list[Sequence]] = {}
    copies = 0
    for k in range(150):
        if rng.random() < 0.3:
            prompt = [rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 20))]  # shared prefixes
            params = SamplingParams(
                max_tokens=rng.randint(1, 20), ignore_eos=True, n=rng.choice([1, 1, 2, 3])
            )
            seq = Sequence(f"r{k}", prompt, params)
            try:
                scheduler.add(seq)
                families[seq.request_id] = [seq]
            except Exception:
                pass  # too long or too wide for this run's sizes
        if rng.random() < 0.1 and families:  # an abort between steps
            for seq in families.pop(rng.choice(list(families))):
                scheduler.finish(seq, FinishReason.ABORT)
        batch = scheduler.schedule()
        if not batch.seqs:
            continue
        copies += len(batch.copies)
        want = rebuilt(batch, bs)
        check(*inputs.prepare(batch), want)
        scheduler.on_computed(batch)
        for seq in want["sampled"]:
            family = families.get(seq.request_id)
            if family is None or seq.is_finished:
                continue
            before = len(family)
            scheduler.fork_pending(seq, into=family)
            for s in (seq, *family[before:]):
                scheduler.append_token(s, rng.randint(1, 50))
        for rid in [r for r, f in families.items() if all(s.is_finished for s in f)]:
            del families[rid]
    return scheduler.num_preemptions, copies


def test_the_persistent_batch_gives_what_rebuilding_would():
    preemptions = copies = 0
    for seed in range(60):
        p, c = simulate(seed)
        preemptions, copies = preemptions + p, copies + c
    assert preemptions > 50 and copies > 50  # the runs took the paths that rewrite rows


def test_a_table_wider_than_the_rows_widens_them():
    bs, blocks = 2, 200
    bm = BlockManager(blocks, bs, enable_prefix_caching=False)
    scheduler = Scheduler(bm, 4, 1000, blocks * bs, (0,))
    inputs = InputBatch(4, blocks, bs)  # rows start 64 blocks wide
    seq = Sequence("long", list(range(1, 300)), SamplingParams(max_tokens=4))
    scheduler.add(seq)
    batch = scheduler.schedule()
    check(*inputs.prepare(batch), rebuilt(batch, bs))


def test_the_engine_prepares_a_step_without_letting_an_abort_in(tiny_llama):
    """An abort frees a sequence's blocks; between scheduling and preparing it would
    leave the sequence's slots to a stale row, another sequence's blocks."""
    from tests.helpers import tiny_engine

    engine = tiny_engine(tiny_llama)
    prepare, held = engine.runner.prepare, []

    def watched(batch):  # noqa: ANN001, ANN202
        held.append(engine.lock._is_owned())  # noqa: SLF001 (RLock's own check)
        return prepare(batch)

    engine.runner.prepare = watched
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_work:
        engine.step()
    assert held and all(held)
