"""EngineStats: a snapshot of what the engine is doing, taken after each step."""

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class EngineStats:
    num_steps: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_contexts: int = 0  # persistent contexts held (Parrot Fill/Generate, slots)
    num_contexts_resident: int = 0  # ... of which have their KV in the cache
    num_context_tokens: int = 0  # tokens across all contexts
    num_context_evictions: int = 0  # contexts that gave up their KV for other requests
    num_context_drops: int = 0  # contexts dropped for max_contexts / max_context_tokens
    batch_num_seqs: int = 0  # sequences in the last step's batch
    batch_num_tokens: int = 0  # tokens in the last step's batch
    max_batch_num_seqs: int = 0  # largest batch so far
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    num_preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (prefilled), all steps
    num_generated_tokens: int = 0
    last_step_time_s: float = 0.0
    stalled_s: float = 0.0  # work waiting and nothing scheduled for this long

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_query_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kv_usage"] = self.kv_usage
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        return d
