"""Speculative decoding by prompt lookup (app/engine/speculation.py) on the real default
model, served quantized as on a CPU: greedy output identical with and without it, with
proposals accepted (so steps yield several tokens); requests that cannot speculate
(sampled, logprobs, n > 1) beside it unchanged; stops and limits exact; no blocks kept;
turned off past `max_running` sequences."""

from pathlib import Path

import pytest

from app.engine import EngineConfig, LLMEngine
from app.engine.config import SpeculativeConfig
from app.engine.speculation import accepted_prefix, lookup
from app.protocol.sampling import SamplingParams
from tests.helpers import chat_ids

GREEDY = SamplingParams(temperature=0, max_tokens=96)
SOURCE = (Path(__file__).parents[2] / "app" / "engine" / "scheduler.py").read_text()[:1500]


@pytest.fixture(scope="module")
def engines(smollm2_quantized):
    """(plain, speculating) engines over the same weights, each its own KV cache."""

    def engine(**overrides) -> LLMEngine:  # noqa: ANN003
        config = EngineConfig(
            device="cpu", dtype="float32", num_threads=2, kv_cache_memory_gib=0.1, **overrides
        )
        return LLMEngine(config, loaded=smollm2_quantized.loaded)

    return engine(), engine(speculative=SpeculativeConfig(num_tokens=4, max_running=5))


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    """Prompts whose answers copy from them (a repeat, a summary, a list)."""
    asks = [
        f"Repeat the following code exactly:\n\n{SOURCE}",
        "Summarize: The quick brown fox jumps over the lazy dog. The quick brown fox is "
        "fast. The lazy dog sleeps all day in the sun.",
        "Write the numbers from 1 to 30, one per line.",
    ]
    return [chat_ids(smollm2_tokenizer, ask) for ask in asks]


def ids(outputs) -> list[list[int]]:  # noqa: ANN001
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_output_is_the_same_with_proposals_accepted(engines, prompts):
    plain, spec = engines
    before = spec.stats_snapshot()
    generated = 0
    for prompt in prompts:  # one at a time: each speculates
        (got,) = ids(spec.generate([prompt], GREEDY))
        assert [got] == ids(plain.generate([prompt], GREEDY))
        generated += len(got)
    stats = spec.stats_snapshot()
    assert stats["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    # each answer's first token comes from its prompt's step: the rest took fewer steps
    steps = stats["num_steps"] - before["num_steps"]
    assert steps - len(prompts) < 0.8 * (generated - len(prompts))
    assert spec.block_manager.stats().used == 0


def test_requests_that_cannot_speculate_are_unchanged_beside_one_that_does(engines, prompts):
    plain, spec = engines
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, seed=7, max_tokens=40),
        SamplingParams(temperature=0, logprobs=2, max_tokens=40),
        SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=30),
    ]
    batch = [prompts[0], prompts[1], prompts[2], prompts[1]]
    before = spec.stats_snapshot()["spec_proposals"]
    want, got = plain.generate(batch, params), spec.generate(batch, params)
    assert spec.stats_snapshot()["spec_proposals"] > before  # the greedy one speculated
    for a, b in zip(want, got, strict=True):
        assert [list(o.token_ids) for o in a.outputs] == [list(o.token_ids) for o in b.outputs]
    assert got[2].outputs[0].logprobs == want[2].outputs[0].logprobs


def test_limits_and_stops_land_where_plain_decoding_puts_them(engines, prompts):
    plain, spec = engines
    (full,) = ids(plain.generate([prompts[0]], GREEDY))
    for params in (
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[full[20]]),
    ):
        want, got = plain.generate([prompts[0]], params), spec.generate([prompts[0]], params)
        assert ids(got) == ids(want)
        assert got[0].outputs[0].finish_reason == want[0].outputs[0].finish_reason
    assert (
        len(ids(spec.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=7)))[0]) == 7
    )


def test_a_full_batch_does_not_speculate(engines, prompts):
    _, spec = engines
    before = spec.stats_snapshot()["spec_proposals"]
    many = [prompts[2]] * 6  # more than max_running from the first step to the last
    spec.generate(many, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert spec.stats_snapshot()["spec_proposals"] == before


def test_preempted_speculating_sequences_give_the_same_output(smollm2_quantized, prompts):
    def engine(**overrides) -> LLMEngine:  # noqa: ANN003
        config = EngineConfig(
            device="cpu",
            dtype="float32",
            num_threads=2,
            num_kv_blocks=40,  # 640 tokens: three long answers do not fit at once
            **overrides,
        )
        return LLMEngine(config, loaded=smollm2_quantized.loaded)

    plain, spec = engine(), engine(speculative=SpeculativeConfig())
    batch = [prompts[0][:300], prompts[1], prompts[2]]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    assert ids(spec.generate(batch, params)) == ids(plain.generate(batch, params))
    assert spec.scheduler.num_preemptions > 0
    assert spec.block_manager.stats().used == 0


def test_lookup_proposes_what_followed_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 9, 2, 3, 4, 5, 6, 1, 2, 3]
    assert lookup(tokens, range(3, 0, -1), 3) == [9, 9, 2]  # "1 2 3" last seen at 0
    assert lookup([5, 2, 3, 7, 8, 2, 3], range(2, 0, -1), 2) == [7, 8]
    assert lookup([4, 2, 3, 7, 8, 2, 3], range(3, 2, -1), 2) == []  # no 3-gram repeats
    assert lookup([7], range(3, 0, -1), 4) == []
    assert lookup([1, 2, 1], range(1, 0, -1), 5) == [2, 1]  # up to what there is


def test_accepted_prefix_stops_at_the_first_miss():
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_prefix([5], [4, 5]) == 0


def test_the_config_refuses_reversed_ngram_bounds():
    with pytest.raises(ValueError, match="min_ngram"):
        SpeculativeConfig(min_ngram=4, max_ngram=2)


def test_sampled_output_keeps_plain_decodings_distribution():
    """Speculative sampling on a small vocabulary: every position's distribution p is
    fixed, the proposal is [0, 1]; the first token must come out as p, the second (after
    an accepted 0) as p again, not as the proposal."""
    import numpy as np
    import torch

    from app.engine.sampler import Sampler
    from app.engine.sequence import Sequence
    from app.engine.speculation import split_verified

    p = np.array([0.5, 0.3, 0.15, 0.05])
    n = 6000
    params = SamplingParams(temperature=1.0, max_tokens=8)
    seqs = [Sequence(f"r{i}", [1, 2, 3], params) for i in range(n)]
    for seq in seqs:
        seq.draft = [0, 1]
    logits = torch.tensor(np.log(p), dtype=torch.float32).repeat(3 * n, 1)
    sampler = Sampler(4, eos_token_ids=(), seed=0)
    _, _, verified = split_verified(logits, seqs, sampler.sample_each)
    outputs = []
    for seq, picks in verified:
        accepted = accepted_prefix(seq.draft, picks)
        outputs.append([*seq.draft[:accepted], picks[accepted]])
    first = np.bincount([o[0] for o in outputs], minlength=4)
    second = np.bincount([o[1] for o in outputs if o[0] == 0], minlength=4)
    # Pearson's chi-square, 3 degrees of freedom: above 16.27 once in a thousand runs
    for counts in (first, second):
        expected = p * counts.sum()
        assert ((counts - expected) ** 2 / expected).sum() < 16.27, counts
    assert sum(len(o) for o in outputs) > 1.5 * n  # proposals were accepted


def test_unseeded_sampled_requests_speculate(engines, prompts):
    _, spec = engines
    before = spec.stats_snapshot()["spec_proposals"]
    params = SamplingParams(temperature=0.5, max_tokens=60, ignore_eos=True)
    (out,) = spec.generate([prompts[0]], params)
    assert len(out.outputs[0].token_ids) == 60
    assert spec.stats_snapshot()["spec_proposals"] > before


def test_a_proposal_stops_before_an_images_placeholders(tmp_path):
    """An image's placeholders stand in a prompt as ids past the vocabulary: a proposal
    copied from before one must stop there (else the embedding fails the whole step)."""
    from tests.helpers import tiny_engine
    from tests.models.test_vision_idefics3 import GLOBAL, IMAGE, VOCAB, build, processed
    from tests.models.vision_checkpoints import save_idefics3_checkpoint

    checkpoint = save_idefics3_checkpoint(tmp_path, VOCAB, IMAGE)
    tokens, inputs, _ = build([[1, 5, 9], processed(7, (40, 30)), [17, 3, GLOBAL]])
    outputs = []
    for speculative in (None, SpeculativeConfig()):
        # the prompt's last token alone in a step: it decodes, and may propose
        engine = tiny_engine(
            checkpoint,
            num_kv_blocks=256,
            max_num_batched_tokens=len(tokens) - 1,
            speculative=speculative,
        )
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        engine.add_request("r", tokens, params, images=inputs)
        out: list[int] = []
        while engine.has_work:
            for d in engine.step():
                assert d.error is None, d.error
                out += d.token_ids
        outputs.append(out)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8


def test_a_proposal_never_preempts_another_sequence():
    from app.engine.block_manager import BlockManager
    from app.engine.scheduler import Scheduler
    from app.engine.sequence import Sequence
    from app.engine.speculation import PromptLookup

    for speculation in (None, PromptLookup(4, 3, 1, 4, vocab_size=100)):
        bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
        scheduler = Scheduler(bm, 8, 64, 1000, (0,), speculation=speculation)
        params = SamplingParams(temperature=0, max_tokens=10)
        a = Sequence("a", [5, 6, 7, 8, 9, 5], params)  # its last 5 was seen: 6 7 8 9 next
        b, c = Sequence("b", [1, 2, 3, 4], params), Sequence("c", [11, 12, 13, 15], params)
        for seq in (a, b, c):
            scheduler.add(seq)
        scheduler.on_computed(scheduler.schedule())  # 4 blocks taken, 2 free
        for seq, token in ((a, 6), (b, 40), (c, 14)):
            scheduler.append_token(seq, token)
        batch = scheduler.schedule()
        assert len(batch.seqs) == 3 and scheduler.num_preemptions == 0


def test_accepted_counts_only_what_came_out():
    from app.engine.block_manager import BlockManager
    from app.engine.scheduler import Scheduler
    from app.engine.sequence import Sequence
    from app.engine.speculation import PromptLookup

    speculation = PromptLookup(4, 3, 1, 4, vocab_size=100)
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(bm, 8, 64, 1000, (0,), speculation=speculation)
    seq = Sequence("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10))
    scheduler.add(seq)
    scheduler.on_computed(scheduler.schedule())
    seq.draft = [0, 7, 8, 5]  # its first token is EOS: the sequence ends there
    assert scheduler.accept_draft(seq, [0, 7, 8, 5, 9]) == (0,)
    assert seq.is_finished
    assert (speculation.counts.draft_tokens, speculation.counts.accepted_tokens) == (4, 1)
