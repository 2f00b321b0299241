"""EngineStats: what the engine is doing, as counters and figures.

Two kinds of fields, kept two ways so that no step pays for a scan:
- step counters (steps, batch sizes, tokens computed and generated, step time) are added
  by `record_step` after each step that ran a forward;
- state figures (queues, KV blocks, preemptions, prefix hits) are read by `record_state`
  from counters the scheduler and block manager keep incrementally (O(1) each), after
  every step and abort and when the stats are asked for;
- context figures that cost a pass over the contexts, and the stall time, are filled in
  only when the stats are asked for (LLMEngine.stats_snapshot).
"""

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.engine.block_manager import BlockManager
    from app.engine.scheduler import ScheduledBatch, Scheduler


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
    kv_tier_blocks: int = 0  # blocks the second tier holds (app/engine/kv_tier.py)
    kv_tier_bytes: int = 0
    kv_tier_hit_tokens: int = 0  # prompt tokens read back from it instead of computed
    kv_tier_saved_blocks: int = 0  # blocks written to it, all time
    kv_tier_read_s: float = 0.0
    kv_tier_write_s: float = 0.0
    num_prompt_tokens: int = 0  # prompt tokens computed (prefilled), all steps
    num_generated_tokens: int = 0
    last_step_time_s: float = 0.0
    stalled_s: float = 0.0  # work waiting and nothing scheduled for this long
    spec_proposals: int = 0  # sequence-steps that verified a proposal (speculation.py)
    spec_draft_tokens: int = 0  # tokens proposed
    spec_accepted_tokens: int = 0  # of which the model accepted
    grammar_mask_steps: int = 0  # steps that computed grammar masks (constrained outputs)
    grammar_mask_s: float = 0.0  # their summed mask time (overlapped with the forward)

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

    def record_speculation(self, counts: Any) -> None:
        """Speculative decoding's counts so far (speculation.SpeculationCounts)."""
        self.spec_proposals = counts.proposals
        self.spec_draft_tokens = counts.draft_tokens
        self.spec_accepted_tokens = counts.accepted_tokens

    def record_step(
        self, num_tokens: int, num_seqs: int, num_sampled: int, num_prefill_tokens: int
    ) -> None:
        """One forward of `num_seqs` sequences and `num_tokens` tokens, of which
        `num_prefill_tokens` were prompt tokens; `num_sampled` tokens came out."""
        self.num_steps += 1
        self.batch_num_tokens, self.batch_num_seqs = num_tokens, num_seqs
        self.max_batch_num_seqs = max(self.max_batch_num_seqs, num_seqs)
        self.num_generated_tokens += num_sampled
        self.num_prompt_tokens += num_prefill_tokens

    def record_state(
        self, scheduler: "Scheduler", block_manager: "BlockManager", num_contexts: int
    ) -> None:
        bm = block_manager.stats()
        self.num_contexts = num_contexts
        self.num_running = len(scheduler.running)
        self.num_waiting = len(scheduler.waiting)
        self.kv_blocks_total, self.kv_blocks_free = bm.total, bm.free
        self.kv_blocks_used, self.kv_blocks_cached = bm.used, bm.cached
        self.num_preemptions = scheduler.num_preemptions
        self.prefix_cache_hit_tokens = bm.prefix_hit_tokens
        self.prefix_cache_query_tokens = bm.prefix_query_tokens
        tier = block_manager.tier
        if tier is not None:
            t = tier.stats
            self.kv_tier_blocks, self.kv_tier_bytes = t.held_blocks, t.held_bytes
            self.kv_tier_hit_tokens = block_manager.tier_hit_tokens
            self.kv_tier_saved_blocks = t.saved_blocks
            self.kv_tier_read_s, self.kv_tier_write_s = t.read_s, t.write_s


def num_prefill_tokens(batch: "ScheduledBatch") -> int:
    """Prompt tokens among a scheduled batch's (taken before the forward: a decode's
    token is an output token, a chunk's are prompt tokens)."""
    return sum(
        max(0, min(s.num_computed_tokens + n, s.num_prompt_tokens) - s.num_computed_tokens)
        for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
    )
