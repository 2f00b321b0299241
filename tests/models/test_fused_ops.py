"""C++ RMSNorm and RoPE (reduced precision on CPU) against the float32 torch reference."""

import pytest
import torch

from app.models import cpu_kernels
from app.models.fused_ops import rms_norm, rotate_heads_


@pytest.fixture(autouse=True)
def need_kernels():
    # setup.sh installs ninja and the machine has a compiler: the kernels must build.
    assert cpu_kernels.load() is not None, "C++ kernels failed to build"


def test_rms_norm_matches_float32_reference():
    torch.manual_seed(0)
    x, w = torch.randn(37, 96), torch.randn(96)
    ref = rms_norm(x, w, 1e-5)  # float32: the transformers formula
    out = rms_norm(x.bfloat16(), w.bfloat16(), 1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.02)


def test_rotary_in_place_touches_only_the_leading_heads():
    torch.manual_seed(0)
    heads, kv_heads, hd, t = 4, 2, 16, 9
    x = torch.randn(t, (heads + 2 * kv_heads) * hd)
    angles = torch.rand(t, hd // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref = x.clone()
    rotate_heads_(ref, (cos, sin), heads + kv_heads, hd)  # float32 torch path
    out = x.bfloat16()
    rotate_heads_(out, (cos, sin), heads + kv_heads, hd)
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.02)
    tail = (heads + kv_heads) * hd
    assert torch.equal(out[:, tail:], x.bfloat16()[:, tail:])  # v untouched
    # rotation keeps each (i, i + hd/2) pair's norm
    first = ref[:, :hd]
    pairs = first[:, : hd // 2] ** 2 + first[:, hd // 2 :] ** 2
    orig = x[:, : hd // 2] ** 2 + x[:, hd // 2 : hd] ** 2
    torch.testing.assert_close(pairs, orig, atol=1e-4, rtol=1e-4)


def test_silu_mul_matches_torch_and_does_not_depend_on_the_row_count():
    kernels = cpu_kernels.load()
    torch.manual_seed(0)
    inter = 13 * 8 + 5  # vectors and a scalar tail
    gate_up = torch.randn(1000, 2 * inter) * 4  # rows enough for both threads (grain 300)
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 60.0, -60.0])
    gate_up[1, 0] = float("nan")
    out = kernels.silu_mul(gate_up)
    ref = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert out.shape == (1000, inter)
    torch.testing.assert_close(out[2:], ref[2:], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out[0], ref[0], atol=1e-6, rtol=1e-5)
    assert out[1, 0].isnan()
    # A row alone (a decode) is the same bits as that row among 1000 (a prefill's threads).
    for row in (0, 7, 499, 500, 999):
        assert torch.equal(kernels.silu_mul(gate_up[row : row + 1].clone())[0], out[row])
    for bad in (gate_up.double(), gate_up[:, :0]):
        with pytest.raises(RuntimeError, match="float32"):
            kernels.silu_mul(bad)
