"""Render workers for chat templates that are not the operator's, and turns between
clients (request_template.py says why they render apart).

`RenderPool` holds the workers (a few) and a bounded, fair waiting line: a render takes
about a millisecond, a runaway one its whole time limit, so one client's runaways must
not hold up another's. A client (whoever the caller says: a key id, an address) has at
most `max_queued_per_client` renders waiting or running. Clients with several renders
here share all but one of the workers between them (a worker killed under a client's
runaway counts as its until the new one has started), so while any number of clients
flood, a client's only render starts at once. A free worker goes to a client with a
single render here first, then to the one that took the least worker time (a runaway
costs its time limit and its worker's restart; a render, a millisecond), then to the one
served least recently. At most `max_queued`
renders wait in all; a client with none waiting takes the place of the newest render of
the client with the most waiting, when that one has several. Past these bounds a render
is refused at once with a 429 (RenderersBusyError), so a flood holds no more than that
many of the caller's threads (the Tokenizer's request slots). Many clients with one
runaway each (many keys, many addresses) still take turns with everyone else. No lock
is held while a worker renders or starts.
"""

import json
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any

from app.protocol.errors import InvalidRequestError
from app.protocol.messages import RenderLimits
from app.text.request_template import (
    RENDER_TIMEOUT_S,
    RenderersBusyError,
    RenderJob,
    char_bound,
)
from app.text.template_worker import TemplateWorker
from app.text.worker_tokenizers import WorkerTokenizers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sandbox:
    """How `chat_prompt` renders the templates that are not the operator's: in `pool`'s
    workers, within `limits`; `model_template`: the model's own template too (one that
    came with a download), not only a request's."""

    pool: "RenderPool"
    limits: RenderLimits = RenderLimits()
    model_template: bool = False


@dataclass
class _Ticket:
    client: str
    granted: threading.Event = field(default_factory=threading.Event)
    slot: "_Slot | None" = None
    since: float = 0.0  # when it was given its slot


@dataclass
class _Slot:
    """One worker's place: its process (None: not started yet), and whether it was
    killed (a new one is then started in the background before the slot is used again)."""

    child: "TemplateWorker | None" = None
    lost: bool = False


class RenderPool:
    """Render workers, a bounded waiting line and turns between clients (see the module's
    docstring). Thread-safe: `render` blocks its caller until its turn and its render."""

    def __init__(
        self,
        workers: int = 2,
        max_queued: int = 32,
        max_queued_per_client: int = 8,
        timeout_s: float = RENDER_TIMEOUT_S,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_queued = max_queued
        self.max_queued_per_client = max_queued_per_client
        # The workers that clients with several renders here share (all but one).
        self.shared_workers = max(1, workers - 1)
        self._lock = threading.Lock()
        self._idle = [_Slot() for _ in range(workers)]
        self._waiting: dict[str, deque[_Ticket]] = {}  # by client, in arrival order
        self._turns = 0
        self._served: dict[str, int] = {}  # the turn each client holding renders had last
        # The worker time each client holding renders has taken since it had none here
        # (a runaway's: its time limit and its worker's restart).
        self._used: dict[str, float] = {}
        self._num_waiting = 0
        self._held: Counter[str] = Counter()  # waiting or running, by client
        self._running: Counter[str] = Counter()
        # A tokenizer's key in the workers, and the JSON they load it from.
        self._tokenizers = WorkerTokenizers()
        self._warmed = False

    def render(
        self,
        job: RenderJob,
        tokenizer: Any = None,
        limits: RenderLimits | None = None,
        param: str = "chat_template",
    ) -> str:
        """The prompt's text under `job`'s template, at most `limits.max_prompt_tokens`
        tokens of `tokenizer`'s (counted in the worker when it has a Rust backend; the
        caller counts otherwise); InvalidRequestError (400, `param`) for a template that
        fails, raises or overruns, RenderersBusyError (429) when the line is full."""
        limits = limits or RenderLimits()
        request = {
            **asdict(job),
            "max_chars": char_bound(limits.max_prompt_tokens),
            "max_tokens": limits.max_prompt_tokens,
            "tokenizer": self._tokenizers.key(tokenizer) if limits.max_prompt_tokens else None,
        }
        line = json.dumps(request, default=str)
        if not self._warmed:
            self.warm()
        ticket = self._admit(limits.client)
        ticket.granted.wait()
        if ticket.slot is None:
            raise RenderersBusyError(
                "chat template: the template workers' line is full, and this render's "
                "place in it went to another client's: retry later"
            )
        try:
            answer = self._run(ticket, request, line, param)
        finally:
            self._release(ticket)
        if "error" in answer:
            raise InvalidRequestError(f"chat template failed: {answer['error']}", param)
        return answer["text"]

    # ---- the waiting line -----------------------------------------------------------
    def _admit(self, client: str) -> _Ticket:
        with self._lock:
            held = self._held[client]
            if held >= self.max_queued_per_client:
                raise RenderersBusyError(
                    f"chat template: this client has {held} renders waiting or running; "
                    f"at most {self.max_queued_per_client}: retry later"
                )
            # Whether it would start now: its only render, or a worker for the clients
            # with several (this one among them once this render is in) is free.
            heavy = sum(n for c, n in self._running.items() if self._held[c] > 1)
            heavy += self._running[client] if held == 1 else 0
            runs_now = bool(self._idle) and (held == 0 or heavy < self.shared_workers)
            if not runs_now and self._num_waiting >= self.max_queued and not self._push_out(client):
                raise RenderersBusyError(
                    f"chat template: {self._num_waiting} renders are waiting for the "
                    "template workers: retry later"
                )
            ticket = _Ticket(client)
            self._held[client] += 1
            self._waiting.setdefault(client, deque()).append(ticket)
            self._num_waiting += 1
            self._grant()
        return ticket

    def _push_out(self, client: str) -> bool:
        """Make room in a full line for a client with no render waiting: the newest of
        those waiting for the client with the most waiting goes (429), if it has more
        than one (the lock held)."""
        if client in self._waiting or not self._waiting:
            return False
        heaviest = max(self._waiting, key=lambda c: len(self._waiting[c]))
        if len(self._waiting[heaviest]) < 2:
            return False
        ticket = self._waiting[heaviest].pop()
        self._num_waiting -= 1
        self._held[heaviest] -= 1
        ticket.granted.set()  # with no slot: refused
        return True

    def _grant(self) -> None:
        """Give idle workers to waiting renders (the lock held). Clients with several
        renders here share all but one of the workers between them (the last is kept for
        a client's only render); a free worker goes to the client `_rank` puts first."""
        while self._idle and self._waiting:
            heavy = sum(n for c, n in self._running.items() if self._held[c] > 1)
            eligible = [
                c for c in self._waiting if self._held[c] == 1 or heavy < self.shared_workers
            ]
            if not eligible:
                return
            client = min(eligible, key=self._rank)
            queue = self._waiting[client]
            ticket = queue.popleft()
            if not queue:
                del self._waiting[client]
            self._turns += 1
            self._served[client] = self._turns
            self._num_waiting -= 1
            self._running[client] += 1
            ticket.slot = self._idle.pop()
            ticket.since = time.monotonic()
            ticket.granted.set()

    def _rank(self, client: str) -> tuple[bool, float, int]:
        """Who of the waiting clients goes first: one with a single render here, then the
        one that took the least worker time, then the one served least recently. By
        time, not turns: a client keeping two runaways here would otherwise take every
        other turn of a shared worker from a client whose renders take milliseconds."""
        return self._held[client] > 1, self._used.get(client, 0.0), self._served.get(client, -1)

    def _release(self, ticket: _Ticket) -> None:
        slot = ticket.slot
        assert slot is not None
        if slot.lost:
            # Its worker was killed: a new one starts in the background, and until it has,
            # the client whose render overran still holds the slot (so its next runaway
            # cannot take the worker that the others are rendering in meanwhile).
            self._in_background(slot, ticket)
            return
        with self._lock:
            self._done(ticket)
            self._idle.append(slot)
            self._grant()

    def _done(self, ticket: _Ticket) -> None:
        client = ticket.client
        self._used[client] = self._used.get(client, 0.0) + time.monotonic() - ticket.since
        for counts in (self._held, self._running):
            counts[client] -= 1
            if counts[client] <= 0:
                del counts[client]
        if client not in self._held:
            self._served.pop(client, None)
            self._used.pop(client, None)

    def _in_background(self, slot: _Slot, ticket: _Ticket | None) -> None:
        """`_replace` on a thread of its own; in this one when no thread can start (the
        slot must come back either way)."""
        try:
            threading.Thread(target=self._replace, args=(slot, ticket), daemon=True).start()
        except RuntimeError:
            self._replace(slot, ticket)

    def warm(self) -> None:
        """Start the workers not started yet, in the background (the first render
        does too)."""
        with self._lock:
            self._warmed = True
            cold = [slot for slot in self._idle if slot.child is None]
            self._idle = [slot for slot in self._idle if slot.child is not None]
        for slot in cold:
            self._in_background(slot, None)

    def _replace(self, slot: _Slot, ticket: _Ticket | None) -> None:
        """Start the slot's worker, with the tokenizers used last, then free the slot
        (and the hold on it of `ticket`'s client, whose render cost the worker)."""
        slot.lost = False
        recent = self._tokenizers.recent()
        try:
            slot.child = TemplateWorker(self.timeout_s)
            for key in recent:
                if not slot.child.load(key, self._tokenizers.source(key)):
                    slot.child.kill()
                    slot.child = None  # the next render starts another
                    break
        except Exception:  # noqa: BLE001 (no process, no start: the slot must come back)
            logger.warning("a chat template worker did not start; the next render starts one")
            slot.child = None
        finally:
            with self._lock:
                if ticket is not None:
                    self._done(ticket)
                self._idle.append(slot)
                self._grant()

    # ---- one render, in the slot's worker ---------------------------------------------
    def _run(self, ticket: _Ticket, request: dict, line: str, param: str) -> dict[str, Any]:
        slot = ticket.slot
        assert slot is not None
        if slot.child is None or slot.child.proc.poll() is not None:
            slot.child = TemplateWorker(self.timeout_s)  # its failure: ShoalError (500)
        child = slot.child
        try:
            answer = child.ask(line, self.timeout_s)
            if "missing" in answer:  # this worker has not loaded the tokenizer yet
                if not self._load(slot, answer["missing"]):
                    line = json.dumps({**request, "tokenizer": None}, default=str)
                answer = slot.child.ask(line, self.timeout_s)  # type: ignore[union-attr]
        except TimeoutError:
            self._lose(slot)
            raise InvalidRequestError(
                f"chat template failed: its render ran over {self.timeout_s:g} s", param
            ) from None
        except (EOFError, OSError):  # the worker died: its memory limit, a crash
            self._lose(slot)
            raise InvalidRequestError(
                "chat template failed: its render ran out of memory", param
            ) from None
        if answer.get("spent"):  # it ran out of memory, and ended: replaced
            self._lose(slot)
        return answer

    def _load(self, slot: _Slot, key: str) -> bool:
        """Load a tokenizer into the slot's worker; on failure (a tokenizer too large for
        the worker's memory) it is never tried again, the caller counts its tokens, and a
        dead worker is replaced at once."""
        child = slot.child
        assert child is not None
        if child.load(key, self._tokenizers.source(key)):
            return True
        logger.warning("a chat template worker could not load a tokenizer; counting outside")
        self._tokenizers.uncountable(key)
        if child.proc.poll() is not None:
            child.kill()
            slot.child = TemplateWorker(self.timeout_s)
        return False

    def _lose(self, slot: _Slot) -> None:
        assert slot.child is not None
        slot.child.kill()
        slot.child = None
        slot.lost = True


_default: RenderPool | None = None
_default_lock = threading.Lock()


def default_pool() -> RenderPool:
    """The process's pool with the default bounds, for callers that bring none."""
    global _default
    with _default_lock:
        if _default is None:
            _default = RenderPool()
        return _default
