"""QuantLinear's fused segments: adjacent segments of one GGML type become one weight
(one kernel call per projection), held once, computing what the segments compute."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from app.models import quant
from app.models.quant.linear_module import QuantLinear
from app.models.quantized_tensor import QuantizedTensor

K = 64


def _segment(rows: int, qtype: int, seed: int) -> QuantizedTensor:
    w = np.random.default_rng(seed).standard_normal((rows, K)).astype(np.float32)
    raw = torch.from_numpy(quants.quantize(w, GGMLQuantizationType(qtype)))
    return QuantizedTensor(raw, qtype, K)


def _layer(spec: list[tuple[int, int]]) -> tuple[QuantLinear, list[QuantizedTensor]]:
    segments = [_segment(rows, qtype, i) for i, (rows, qtype) in enumerate(spec)]
    layer = QuantLinear(K, [rows for rows, _ in spec])
    for i, segment in enumerate(segments):
        layer.set_segment(i, segment)
    return layer, segments


@pytest.mark.parametrize(
    ("spec", "calls"),
    [
        ([(8, 3), (4, 3), (6, 3)], 1),  # q|k|v of one type: one weight
        ([(8, 3), (4, 8), (8, 3)], 3),  # types alternate: nothing merges
        ([(6, 3), (4, 3)], 2),  # 6 rows end in a padded group: not merged
        ([(8, 3), (8, 3), (4, 8)], 2),
    ],
)
def test_segments_of_one_type_merge(spec, calls):
    layer, segments = _layer(spec)
    assert len(layer._runs) == calls
    assert len(layer.segments) == len(spec)  # the loader's view of the layer is unchanged
    x = torch.randn(3, K)
    expected = torch.cat([x @ s.dequantize().T for s in segments], dim=1)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (3, sum(rows for rows, _ in spec))
    # the kernels may round x to int8 per block: compare at that precision
    assert torch.allclose(out, expected, atol=0.05 * float(expected.abs().max()))
    # each segment's own product is what the fused call wrote in its columns
    start = 0
    for segment, (rows, _) in zip(layer.segments, spec, strict=True):
        alone = quant.matmul(x, segment)
        assert torch.allclose(out[:, start : start + rows], alone, atol=1e-5)
        start += rows


def test_merged_weight_is_held_once():
    layer, segments = _layer([(8, 3), (4, 3), (6, 3)])
    merged = layer._runs[0][0]
    assert merged.n == 18
    for segment in layer.segments:  # views into the merged weight's storage
        assert segment.parts[0].untyped_storage().data_ptr() == (
            merged.parts[0].untyped_storage().data_ptr()
        )
    assert layer.nbytes() <= merged.nbytes
