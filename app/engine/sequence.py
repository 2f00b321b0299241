"""Sequence: one output stream's tokens and KV bookkeeping; plain state, no behaviour."""

import itertools
from enum import Enum, auto

import torch

from app.protocol.outputs import FinishReason, TokenLogprob
from app.protocol.sampling import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Tokens are `prompt + outputs`; the first `num_computed_tokens` have KV in the cache.

    `block_table[i]` holds tokens [i * block_size, (i + 1) * block_size). `block_hashes`
    has one entry per full block whose contents are registered for prefix caching.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        arrival: float = 0.0,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n outputs
        self.params = params
        self.arrival = arrival
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.logprobs: list[TokenLogprob] = []
        self.pending_forks = params.n - 1 if index == 0 else 0
        self.passed_over = 0  # admissions of later requests while this one had no seats
        self.generator: torch.Generator | None = None
        self.context = None  # a contexts.ContextOp when this request runs on a context
        self.matcher = None  # llguidance's state of a constrained output (app.engine.grammar)
        self.images: list = []  # app.engine.images.SeqImage, by position
        self.rope = None  # app.engine.mrope.RopePositions: 3-D positions (Qwen2.5-VL)
        self.draft: list[int] = []  # tokens this step verifies after the last (speculation.py)
        self.lora = None  # the app.models.lora.LoraAdapter it runs with; None: the base
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cache_salt(self) -> int | None:
        """Where its chain of prefix-cache hashes starts: KV computed with an adapter is
        that adapter's (that load's) alone."""
        return None if self.lora is None else hash(("lora", self.lora.uid))

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, index: int) -> "Sequence":
        """A sibling output sharing this sequence's tokens (blocks are shared by the
        block manager, not here)."""
        child = Sequence(
            self.request_id,
            self.token_ids[: self.num_prompt_tokens],
            self.params,
            index,
            self.arrival,
        )
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.images, child.rope, child.lora = self.images, self.rope, self.lora
        if self.matcher is not None:  # forks happen before the first token: same state
            child.matcher = self.matcher.deep_copy()
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.index}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, {self.status.name})"
        )
