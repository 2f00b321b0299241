"""Constrained decoding: a request's Constraint becomes a matcher that follows its
sequence token by token and says, before each sample, which tokens may come next.

The library is llguidance. Measured on this machine (bench/grammar_libraries.py, SmolLM2's
49k vocabulary, 32 sequences under one JSON schema): its masks take ~0.4 ms a step
against xgrammar's ~0.1 ms, both under 1 % of a 32-stream decode step, so the step does
not tell them apart. What does: llguidance builds its lexer lazily (no compile pause,
~0.6 ms for a new schema), bounds every step with fuel limits a hostile grammar cannot
exceed, reads llama.cpp's GBNF, and installs without dependencies, where xgrammar pulls
triton and a compiler runtime into a CPU build.

How it meets the batch: the masks of a step's constrained sequences are computed on a
worker thread while the model runs (llguidance drops the GIL), then the sampler applies
them after biases and penalties, to those rows only.

A matcher's state is a function of its sequence's output tokens. A preempted sequence
keeps its tokens (preemption recomputes KV, it never drops tokens), so its matcher stays
valid; a fork copies its parent's matcher at the first token; a finished sequence drops
its matcher.
"""

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from app.models.source import ModelSource
from app.protocol.errors import InvalidRequestError
from app.protocol.sampling import Constraint, ConstraintKind, SamplingParams

logger = logging.getLogger(__name__)

CACHED_GRAMMARS = 256  # pristine matchers, by constraint; a sequence gets a copy
# JSON as models write it (`json.dumps`'s separators), without free whitespace: a small
# model let loose on whitespace can pad forever.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

_tokenizers: dict[tuple[ModelSource, int, tuple[int, ...]], Any] = {}
_tokenizers_lock = threading.Lock()


def _limits() -> Any:
    import llguidance

    # The fuel bounds the lexer build (a new grammar) to ~20 ms and a mask to ~15 ms.
    return llguidance.LLParserLimits(
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        max_grammar_size=200_000,
        verbose_errors=False,  # an error names the problem, not the parser's whole state
    )


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint; InvalidRequestError when its text is not
    what its kind says (the grammar itself is checked when a matcher is built)."""
    from llguidance import LLMatcher, grammar_from

    spec, kind = constraint.spec, constraint.kind
    try:
        if kind is ConstraintKind.JSON:
            schema = json.loads(spec)
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema must be an object")
            return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        if kind is ConstraintKind.REGEX:
            return LLMatcher.grammar_from_regex(spec)
        if kind is ConstraintKind.CHOICE:
            choices = json.loads(spec)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError("choices must be a non-empty list of strings")
            return grammar_from("choice", spec)
        if kind is ConstraintKind.GRAMMAR:
            return grammar_from("grammar", spec)
        return LLMatcher.grammar_from_lark(spec)
    except ValueError as exc:
        raise InvalidRequestError(f"invalid {kind} constraint: {exc}") from exc


def llg_tokenizer(source: ModelSource, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """The model's vocabulary as llguidance reads it; once per process (loading a GGUF's
    tokenizer takes seconds)."""
    key = (source, vocab_size, eos_token_ids)
    with _tokenizers_lock:
        if key not in _tokenizers:
            import llguidance.hf

            from app.text.tokenizer import load_tokenizer

            hf = load_tokenizer(source)
            _tokenizers[key] = llguidance.hf.from_tokenizer(
                hf, n_vocab=vocab_size, eos_token=list(eos_token_ids)
            )
        return _tokenizers[key]


@dataclass
class StepMasks:
    """One step's masks, one row per constrained sequence due to sample, as a bias to add
    to the logits (0 where a token is allowed, -inf where not): made on the grammar's
    thread, so the step only adds it."""

    rows: dict[int, int]  # seq_id -> row
    bias: torch.Tensor  # (rows, vocab) float32
    errors: dict[int, str] = field(default_factory=dict)  # seq_id -> its matcher's error
    seconds: float = 0.0

    def forbidden(self, seq_ids: list[int | None]) -> "Forbidden | None":
        """For the sampled rows (by the seq_id whose mask each uses; None: a row without
        one), the bias of the constrained ones; None when no row is constrained."""
        rows = [i for i, s in enumerate(seq_ids) if s is not None and s in self.rows]
        if not rows:
            return None
        picked = [self.rows[seq_ids[i]] for i in rows]  # type: ignore[index]
        bias = self.bias if picked == list(range(len(self.bias))) else self.bias[picked]
        return Forbidden(rows, bias)


@dataclass
class Forbidden:
    """What rows `rows` of a batch may not take: `bias[k]` (0 or -inf) is row `rows[k]`'s."""

    rows: list[int]
    bias: torch.Tensor  # (len(rows), vocab) float32

    def row(self, i: int) -> "Forbidden | None":
        """Row `i`'s alone, as a batch of one."""
        if i not in self.rows:
            return None
        k = self.rows.index(i)
        return Forbidden([0], self.bias[k : k + 1])

    def apply_(self, logits: torch.Tensor) -> None:
        """Add the bias to `logits` (float32, rows as in the batch), in place: an add, not a
        masked fill (several times faster on a CPU)."""
        bias = self.bias.to(logits.device)
        if len(self.rows) == logits.shape[0]:
            logits.add_(bias)
        else:
            logits.index_add_(0, torch.tensor(self.rows, device=logits.device), bias)


_NEG_INF_BITS = np.float32(-np.inf).view(np.int32)


def _bias(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """llguidance's packed masks (bit set: allowed) as 0 / -inf float32 rows. In integer
    numpy on the grammar's thread: (bit - 1) & bits(-inf) is 0 or -inf's bit pattern, read
    as float32 (~0.5 ms for 32 rows; torch here would start a second OpenMP team beside
    the forward's)."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    bias = bits.astype(np.int32)
    bias -= 1
    bias &= _NEG_INF_BITS
    return torch.from_numpy(bias.view(np.float32))


class GrammarBackend:
    """Matchers for this engine's model, and the step's masks on a worker thread."""

    def __init__(self, source: ModelSource, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self._args = (source, vocab_size, tuple(eos_token_ids))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._pristine: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: Any = None
        self.mask_seconds = 0.0  # summed over steps, for stats and benchmarks
        self.mask_steps = 0
        # Loaded here, before the engine reports ready, not on a thread behind it: a
        # replica that said it was ready kept its first constrained request waiting for
        # this (56.7 s once, beside a starting replica). Alone it costs ~0.7 s (SmolLM2's
        # 49k vocabulary, its tokenizer already converted); on a thread beside the weights'
        # load it also raced transformers' lazy imports (ImportError).
        self._tokenizer: Any = None
        self._tokenizer_error: Exception | None = None
        started = time.perf_counter()
        try:
            self._tokenizer = llg_tokenizer(*self._args)
        except Exception as exc:  # e.g. a slow (Python) tokenizer: llguidance reads fast ones
            self._tokenizer_error = exc
            logger.warning("structured outputs are unavailable for %s: %s", source.name, exc)
        else:
            self._warm_up()
        logger.info("grammar vocabulary ready in %.2f s", time.perf_counter() - started)

    def vocabulary_loaded(self) -> bool:
        """Whether the model's vocabulary is loaded (a constrained request compiles its
        grammar at once); False only when it cannot be (every one is then refused)."""
        return self._tokenizer is not None

    def _warm_up(self) -> None:
        """Compile a grammar and compute its mask once, so that what llguidance builds on
        first use (its executor, the bias's buffers) is not the first request's to wait
        for; the step's figures leave it out."""
        matcher = self.matcher(Constraint(kind=ConstraintKind.JSON, spec='{"type": "object"}'))
        self._pool.submit(self._fill, [(0, matcher)]).result()  # on the thread steps use
        self.mask_seconds, self.mask_steps = 0.0, 0

    def matcher(self, constraint: Constraint) -> Any:
        """A fresh matcher for one sequence; InvalidRequestError naming the problem when
        the constraint does not compile or exceeds the compiler's limits."""
        with self._lock:
            pristine = self._pristine.get(constraint)
            if pristine is not None:
                self._pristine.move_to_end(constraint)
                return pristine.deep_copy()
        from llguidance import LLMatcher

        grammar = grammar_text(constraint)
        tokenizer = self._tokenizer
        if tokenizer is None:
            raise InvalidRequestError(
                f"structured outputs are unavailable for this model: {self._tokenizer_error}"
            ) from self._tokenizer_error
        started = time.perf_counter()
        pristine = LLMatcher(tokenizer, grammar, log_level=0, limits=_limits())
        if pristine.is_error():
            raise InvalidRequestError(
                f"invalid {constraint.kind} constraint: {_first_line(pristine)}"
            )
        logger.debug(
            "compiled a %s constraint in %.1f ms",
            constraint.kind,
            1e3 * (time.perf_counter() - started),
        )
        with self._lock:
            self._pristine[constraint] = pristine
            while len(self._pristine) > CACHED_GRAMMARS:
                self._pristine.popitem(last=False)
        return pristine.deep_copy()

    def start_masks(self, seqs: list[Any]) -> "Future[StepMasks] | None":
        """Compute the masks of `seqs` (those with a matcher) on the worker thread; None
        when none has one."""
        pairs = [(s.seq_id, s.matcher) for s in seqs if s.matcher is not None]
        if not pairs:
            return None
        return self._pool.submit(self._fill, pairs)

    def _fill(self, pairs: list[tuple[int, Any]]) -> StepMasks:
        import llguidance
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

        started = time.perf_counter()
        if self._executor is None:
            self._executor = llguidance.LLExecutor(1)
        bitmask = allocate_token_bitmask(len(pairs), self.vocab_size)
        fill_next_token_bitmask_par(
            self._executor, [(m, row) for row, (_, m) in enumerate(pairs)], bitmask
        )
        rows = {sid: row for row, (sid, _) in enumerate(pairs)}
        masks = StepMasks(rows, _bias(bitmask, self.vocab_size))
        for sid, m in pairs:
            if m.is_error():
                masks.errors[sid] = _first_line(m)
        masks.seconds = time.perf_counter() - started
        self.mask_seconds += masks.seconds
        self.mask_steps += 1
        return masks

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def request_matcher(grammar: GrammarBackend | None, params: SamplingParams) -> Any:
    """A constrained request's matcher (llguidance's LLMatcher), built before it is
    queued, so that a bad schema or grammar is refused (400) rather than failing in a
    step; None for a request without a constraint."""
    if params.constraint is None:
        return None
    if grammar is None:
        raise InvalidRequestError("structured outputs are turned off for this model")
    return grammar.matcher(params.constraint)


def _first_line(matcher: Any) -> str:
    return (matcher.get_error() or "unknown error").strip().splitlines()[0][:500]
