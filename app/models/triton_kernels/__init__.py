"""Triton kernels over the paged KV cache, in the torch backend's layout
(num_blocks, nkv, block_size, hd): the cache write, split-K decode attention and
variable-length prefill attention. They run on CUDA, and on the CPU under Triton's
interpreter (TRITON_INTERPRET=1, set before triton is imported), which the tests use.

Shared semantics: a query at position p sees keys j with p - window < j <= p (window 0:
no limit); scores, already scaled, become softcap * tanh(score / softcap) before masking
when softcap > 0; the softmax runs online in float32; outputs take the query's dtype;
any cache dtype (float32, float16, bfloat16) is widened to float32 on load.
"""

from app.models.triton_kernels.cache_write import write_kv_cache
from app.models.triton_kernels.decode import (
    MAX_SPLITS,
    MIN_PARTITION,
    decode_splits,
    paged_decode_attention,
    split_count,
)
from app.models.triton_kernels.prefill import paged_prefill_attention

__all__ = [
    "MAX_SPLITS",
    "MIN_PARTITION",
    "decode_splits",
    "paged_decode_attention",
    "paged_prefill_attention",
    "split_count",
    "write_kv_cache",
]
