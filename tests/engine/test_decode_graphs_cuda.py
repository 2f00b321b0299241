"""CUDA graphs captured for real: collected only where CUDA is (tests/conftest.py leaves
this file out elsewhere; scripts/gpu_check.sh runs it on the GPU host). On a CPU the
same static-buffer path runs eagerly in tests/engine/test_decode_graphs.py."""

import pytest

from app.protocol import SamplingParams
from tests.engine.test_decode_graphs import _outputs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_graphs_replay_the_static_path(tiny_llama, dtype):
    """On a GPU: replaying the captured graphs gives the bits of the same static path run
    eagerly (the same kernels on the same padded buckets), and the plain path's tokens."""
    from tests.helpers import tiny_engine

    prompts = [[5, 6, 7, 8], [100, 3, 44], [9] * 11, [200, 201], [17] * 30]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
        for n in (20, 7, 12, 3, 16)
    ]
    settings = dict(device="cuda", dtype=dtype, num_kv_blocks=128, max_num_seqs=16)
    captured = tiny_engine(tiny_llama, **settings)
    runner = captured.runner
    assert runner.backend.name in ("triton", "flash") and runner.decode_graphs is not None
    assert runner.decode_graphs.graphs  # one per bucket: 1, 2, 4, 8, 16
    assert runner.decode_graphs.capture_s > 0
    replayed = _outputs(captured, prompts, params)
    eager = tiny_engine(tiny_llama, cuda_graphs=False, **settings)
    assert eager.runner.decode_graphs is None
    assert eager.runner.use_decode_graphs(capture=False)
    assert _outputs(eager, prompts, params) == replayed
    plain = tiny_engine(tiny_llama, cuda_graphs=False, **settings)
    if dtype == "float32":  # bfloat16's roundings may differ with the GEMM's row count
        got = [[tokens for tokens, _ in out] for out in _outputs(plain, prompts, params)]
        assert got == [[tokens for tokens, _ in out] for out in replayed]
