"""DecodeGraphs' static path (buckets, padding rows, replay into the same buffers), run
eagerly on the CPU: the tokens are the ones the plain path gives. A CUDA graph replays
exactly this path's forward, so what is checked here is what a GPU replays (the capture
itself needs CUDA: the GPU check runs it)."""

import pytest
import torch

from app.engine import EngineConfig, LLMEngine
from app.engine.decode_graphs import bucket_sizes
from app.protocol import SamplingParams

PROMPTS = [
    [1, 504, 3458, 282, 4649, 314, 260, 1345] * 3,
    list(range(200, 237)),
    [42, 43, 44],
    list(range(900, 1000)),
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
]
# Different lengths: the batch shrinks through the buckets (5 -> 4 ... -> 1), so rows a
# larger step used become padding.
PARAMS = [
    SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
    for n in (24, 5, 13, 9, 2)
]


def test_bucket_sizes():
    assert bucket_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert bucket_sizes(1000)[-1] == 256
    assert bucket_sizes(100)[-1] == 112  # every batch up to max_num_seqs has one
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(5) == [1, 2, 4, 5]
    assert bucket_sizes(1) == [1]


def _outputs(engine: LLMEngine, prompts, params) -> list:
    outs = engine.generate(prompts, params)
    return [[(o.token_ids, o.logprobs) for o in out.outputs] for out in outs]


def _static_twin(engine: LLMEngine, **overrides) -> LLMEngine:
    """An engine over the same weights whose decode steps take the static path."""
    config = engine.config.model_copy(update=overrides)
    twin = LLMEngine(config, loaded=engine.loaded)
    assert twin.runner.use_decode_graphs(capture=False)
    return twin


@pytest.fixture(scope="module")
def quantized_engine(smollm2_quantized) -> LLMEngine:
    """The default GGUF, quantized: its forward is batch-invariant (int8 activations,
    attention a token at a time), so padding rows may change no bit of a real row."""
    config = EngineConfig(device="cpu", dtype="float32", num_threads=2, kv_cache_memory_gib=0.1)
    return LLMEngine(config, loaded=smollm2_quantized.loaded)


def test_static_decode_gives_the_plain_paths_bits(quantized_engine):
    plain = _outputs(quantized_engine, PROMPTS, PARAMS)
    static = _static_twin(quantized_engine)
    calls = []
    graphs = static.runner.decode_graphs
    run = graphs.run
    graphs.run = lambda step: calls.append(len(step.layout.query_lens)) or run(step)
    assert _outputs(static, PROMPTS, PARAMS) == plain
    # every decode step went through it, and the batch crossed buckets
    assert set(calls) == {5, 4, 3, 2, 1}
    assert {graphs.bucket_for(n) for n in calls} == {8, 4, 2, 1}


def test_static_decode_with_forks_and_seeds(quantized_engine):
    """n > 1 forks share blocks (copy-on-write before the step), seeded sampling."""
    params = [
        SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    ]
    prompts = PROMPTS[:2]
    plain = _outputs(quantized_engine, prompts, params)
    assert _outputs(_static_twin(quantized_engine), prompts, params) == plain


def test_padding_rows_point_at_the_scratch_block(quantized_engine):
    """Rows a larger step filled become padding again when the batch shrinks: a stale
    slot would write a block that may by then belong to another sequence."""
    static = _static_twin(quantized_engine)
    runner, graphs = static.runner, static.runner.decode_graphs
    loads = []
    load = graphs._load
    graphs._load = lambda step, n, bucket: (load(step, n, bucket), loads.append((n, bucket)))
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        static.add_request(f"r{i}", prompt, params)
    scratch = runner.scratch_block
    assert scratch == runner.num_blocks  # past every block the block manager hands out
    while static.has_work:
        static.step()
        if not loads:
            continue
        n, bucket = loads.pop()
        pad = slice(n, graphs.slots.shape[0])
        assert (graphs.slots[pad] == scratch * runner.block_size).all()
        assert (graphs.tables[pad, 0] == scratch).all() and (graphs.lens[pad] == 1).all()
        assert (graphs.input_ids[pad] == 0).all() and (graphs.positions[pad] == 0).all()
        live = graphs.slots[:n] // runner.block_size
        assert (live != scratch).all()
    assert runner.k_caches[0][scratch].abs().sum() > 0  # padding rows did write there


@pytest.fixture(scope="module")
def float_engine(smollm2_engine) -> LLMEngine:
    """The default model dequantized to float32: plain nn.Linear layers and the torch
    backend's C++ kernels, the layers a GPU graph holds."""
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        quantization="none",
        num_threads=2,
        kv_cache_memory_gib=0.1,
    )
    return LLMEngine(config, loaded=smollm2_engine.loaded)


def test_static_decode_of_float_layers(float_engine):
    plain = _outputs(float_engine, PROMPTS, PARAMS)
    static = _static_twin(float_engine)
    got = _outputs(static, PROMPTS, PARAMS)
    # A GEMM of 8 padded rows may sum in another order than one of 5: same tokens,
    # log-probabilities equal to float32 rounding.
    for mine, theirs in zip(got, plain, strict=True):
        (tokens, logprobs), (want_tokens, want_logprobs) = mine[0], theirs[0]
        assert tokens == want_tokens
        for a, b in zip(logprobs, want_logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_graphs_only_where_a_graph_holds_the_model(quantized_engine, float_engine):
    from app.engine.model_runner import graph_unsafe_reason

    assert graph_unsafe_reason(float_engine.runner.model) is None
    reason = graph_unsafe_reason(quantized_engine.runner.model)
    assert reason is not None and "Quant" in reason
    # capture=True refuses it before touching CUDA
    twin = LLMEngine(quantized_engine.config, loaded=quantized_engine.loaded)
    assert not twin.runner.use_decode_graphs(capture=True)
    assert twin.runner.decode_graphs is None


def test_the_torch_backends_gathers_take_no_static_tables(float_engine):
    from app.models.torch_attention import TorchPagedAttention

    backend = TorchPagedAttention(torch.device("cpu"))
    backend.kernels = None  # the GPU's torch path
    with pytest.raises(NotImplementedError):
        backend.decode_metadata(torch.zeros(1).long(), torch.zeros(1, 4).int(), torch.ones(1).int())


def test_static_decode_over_the_triton_kernels(tiny_llama):
    """The backend a GPU graph holds, on full-width static tables (on a CPU in Triton's
    interpreter, tests/conftest.py): the tokens of the same kernels on per-step tables."""
    pytest.importorskip("triton")
    from tests.helpers import tiny_engine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = dict(device=device, attention_backend="triton", cuda_graphs=False)
    prompts = [[42, 43, 44], [9] * 11, [200, 201]]  # the tiny vocabulary's
    params = [PARAMS[2].model_copy(update={"max_tokens": n}) for n in (4, 2, 3)]
    plain = tiny_engine(tiny_llama, **settings)
    static = tiny_engine(tiny_llama, **settings)
    assert static.runner.use_decode_graphs(capture=False)
    assert static.runner.decode_graphs.tables.shape[1] == static.runner.max_blocks
    got, want = _outputs(static, prompts, params), _outputs(plain, prompts, params)
    # The same tokens; a float model's GEMMs over the static path's padded batch may round
    # differently in the last bits on some CPUs (seen on AVX2: 5e-7 in a logprob).
    assert [[t for t, _ in out] for out in got] == [[t for t, _ in out] for out in want]
    for out, ref in zip(got, want, strict=True):
        for (_, lps), (_, ref_lps) in zip(out, ref, strict=True):
            for lp, ref_lp in zip(lps, ref_lps, strict=True):
                assert lp.token_id == ref_lp.token_id
                assert lp.logprob == pytest.approx(ref_lp.logprob, abs=1e-5)
                assert [t for t, _ in lp.top] == [t for t, _ in ref_lp.top]
                assert [v for _, v in lp.top] == pytest.approx([v for _, v in ref_lp.top], abs=1e-5)
