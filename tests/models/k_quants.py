"""Q4_K and Q5_K quantizers in numpy, for test and benchmark files: gguf-py dequantizes
the K types but cannot quantize them. Plain min/max per 32-weight sub-block (llama.cpp
also searches scales to lower the error; the format, which is what the loaders and
kernels read, is the same).

Per 256 weights: d and dmin (fp16); 12 bytes of 6-bit scales and mins of the 8
sub-blocks; Q5_K then 32 bytes of fifth bits (bit s of byte j: weight 32 s + j); then 128
bytes of 4-bit quants, each 64 weights' 32 bytes holding the first 32 in their low
nibbles and the next 32 in their high ones. A weight is d * scale * q - dmin * min.
Q4_K: 144 bytes, q < 16; Q5_K: 176 bytes, q < 32.
"""

import numpy as np

BLOCK = 256


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """(..., K) float32, K a multiple of 256 -> (..., K / 256 * 144) uint8."""
    return _quantize_k(weights, bits=4)


def quantize_q5_k(weights: np.ndarray) -> np.ndarray:
    """(..., K) float32, K a multiple of 256 -> (..., K / 256 * 176) uint8."""
    return _quantize_k(weights, bits=5)


def _quantize_k(weights: np.ndarray, bits: int) -> np.ndarray:
    shape = weights.shape
    top = (1 << bits) - 1
    w = weights.reshape(-1, 8, 32).astype(np.float32)  # (blocks, sub-blocks, 32)
    low = np.minimum(w.min(axis=-1), 0.0)
    scale = (w.max(axis=-1) - low) / top
    mins = -low
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.where(df > 0, np.rint(scale / np.where(df > 0, df, 1)), 0).clip(0, 63).astype(np.uint8)
    mn = np.where(dminf > 0, np.rint(mins / np.where(dminf > 0, dminf, 1)), 0)
    mn = mn.clip(0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    offset = (dminf * mn)[..., None]
    q = np.where(step > 0, np.rint((w + offset) / np.where(step > 0, step, 1)), 0)
    q = q.clip(0, top).astype(np.uint8)  # (blocks, sub-block s, weight j)
    nibbles = (q & 15).reshape(-1, 4, 2, 32)  # (blocks, 64-chunk, half, 32)
    qs = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(-1, 128)
    packed = np.zeros((w.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    parts = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed]
    if bits == 5:
        fifth = (q >> 4).astype(np.uint8)  # (blocks, s, j)
        parts.append((fifth << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8))
    out = np.concatenate([*parts, qs], axis=1)
    return out.reshape(*shape[:-1], -1)
