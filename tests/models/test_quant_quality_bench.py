"""bench/quant_quality.py's perplexity is the textbook one: on a tiny float32 checkpoint it
equals transformers' over the same windows (scoring each window's second half, as
llama-perplexity does: logits at ctx/2 .. ctx-2 predict the tokens after them)."""

import importlib.util
import math
import sys
from pathlib import Path

import torch

from tests.helpers import save_tiny_checkpoint, tiny_engine

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench_module():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("quant_quality", BENCH / "quant_quality.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_perplexity_equals_transformers(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    directory = save_tiny_checkpoint(tmp_path)
    ids = [(i * 37 + 11) % 250 + 3 for i in range(3 * 16 + 5)]  # three windows of 16, a rest
    ppl, scored = _bench_module().perplexity(tiny_engine(directory), ids, ctx=16)
    assert scored == 3 * 7
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    nll = 0.0
    for start in range(0, 48, 16):
        window = torch.tensor([ids[start : start + 16]])
        with torch.inference_mode():
            logprobs = torch.log_softmax(hf(window).logits[0].float(), -1)
        nll -= sum(float(logprobs[i - 1, window[0, i]]) for i in range(9, 16))
    assert abs(ppl - math.exp(nll / scored)) < 1e-3 * ppl
