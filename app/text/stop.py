"""StopStrings: cut streamed text at the earliest stop string, even when it spans deltas.

Invariants, for any way the text is split into deltas:
- The output is the whole text up to the earliest-STARTING occurrence of any stop string
  (ties at one start go to the shortest stop, i.e. `min((index, stop))` over
  `text.find(stop)`), or the whole text when no stop string occurs. Splitting never
  changes the result.
- Nothing at or after that stop string is ever emitted.
- Text is held back only while it is undecided: while it is a prefix of some stop string,
  or while a stop found later in the text may still be beaten by a longer one that started
  earlier and is still partially matched. `flush()` settles what is held at the end.

Why an Aho-Corasick automaton: `text.find(stop)` for every stop on every delta costs
O(stops x buffer) per delta (300k stop strings took 0.1 s a delta). The automaton is built
once per request over the stop strings and advanced only over the newly fed characters, so
matching costs O(characters fed) whatever the number of stops; the text held back is at
most the longest stop string (capped by MAX_STOP_STRING_CHARS), so the copies made while
holding it back are bounded too.
"""

from app.protocol.errors import InvalidRequestError

MAX_STOP_STRINGS = 64  # per request; the automaton's size grows with their total length
MAX_STOP_STRING_CHARS = 1024  # per string; also bounds the text held back per output


def check_stop_strings(stops: list[str], param: str) -> list[str]:
    """The request's stop strings without empty ones; raises InvalidRequestError (400)
    when there are more than MAX_STOP_STRINGS or one is longer than MAX_STOP_STRING_CHARS."""
    kept = [s for s in stops if s]  # an empty stop would match everywhere: ignored, as ever
    if len(kept) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            f"{param} has {len(kept)} stop strings; at most {MAX_STOP_STRINGS} are allowed",
            param,
        )
    for i, stop in enumerate(kept):
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                f"stop string {i} of {param} is {len(stop)} characters long; "
                f"at most {MAX_STOP_STRING_CHARS} characters are allowed",
                param,
            )
    return kept


class _Automaton:
    """Aho-Corasick over the stop strings. Node 0 is the root; a node is the string spelled
    on the path to it. `depth[n]` is that string's length; `longest[n]` is the length of the
    longest stop string that is a suffix of it (0 if none): at a given end position the
    longest stop is the earliest-starting one."""

    def __init__(self, stops: list[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        terminal = [False]
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    terminal.append(False)
                node = nxt
            terminal[node] = True
        fail = [0] * len(goto)
        longest = [0] * len(goto)
        # Breadth-first, so a node's failure target (shallower) is complete before it.
        queue = list(goto[0].values())
        for node in queue:
            longest[node] = depth[node] if terminal[node] else 0
        head = 0
        while head < len(queue):
            node = queue[head]
            head += 1
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0)  # shallower than child: never itself
                longest[child] = depth[child] if terminal[child] else longest[fail[child]]
                queue.append(child)
        self.goto = goto
        self.fail = fail
        self.depth = depth
        self.longest = longest


class StopStrings:
    """Feed text deltas in order; emit what `feed` and `flush` return."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text
        self._ac = _Automaton(self.stops) if self.stops else None
        self._state = 0  # automaton node after the text fed so far
        self._pos = 0  # characters fed so far (absolute positions below count from 0)
        self._emitted = 0  # characters emitted so far
        self._pending = ""  # text[_emitted:_pos]: fed, held back
        self._best_start = -1  # start of the earliest stop found so far, -1 if none
        self._best_len = 0

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit; sets `stopped` when a stop string appears."""
        if self.stopped:
            return ""
        ac = self._ac
        if ac is None:
            return text
        goto, fail, depth, longest = ac.goto, ac.fail, ac.depth, ac.longest
        state, pos, best = self._state, self._pos, self._best_start
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            pos += 1
            n = longest[state]
            if n and (best < 0 or pos - n < best):  # same start, later end: longer, loses
                best, self._best_len = pos - n, n
            # The partial match (state) is the earliest start any future stop can have;
            # once it starts at or after the best one, nothing can beat the best.
            if best >= 0 and pos - depth[state] >= best:
                self._best_start = best
                return self._cut(self._pending + text[: i + 1])
        self._state, self._pos, self._best_start = state, pos, best
        # Undecided from the partial match on (a pending best starts after it).
        return self._release(text, pos - depth[state])

    def flush(self) -> str:
        """At the end of the stream: the text still held back, up to a pending stop."""
        if self.stopped:
            return ""
        if self._best_start >= 0:
            return self._cut(self._pending)
        out, self._pending = self._pending, ""
        self._emitted = self._pos
        return out

    def _release(self, text: str, safe_end: int) -> str:
        """Emits text[_emitted:safe_end] and keeps text[safe_end:_pos] pending."""
        cut = safe_end - self._emitted
        if cut <= 0:
            self._pending += text
            return ""
        keep = self._pos - safe_end
        if cut <= len(self._pending):  # only a part of the old pending is released
            buffer = self._pending + text
            out, self._pending = buffer[:cut], buffer[cut:]
        else:
            out = self._pending + text[: len(text) - keep]
            self._pending = text[len(text) - keep :] if keep else ""
        self._emitted = safe_end
        return out

    def _cut(self, buffer: str) -> str:
        """Ends the text at the best stop; `buffer` is the text from _emitted on."""
        start = self._best_start - self._emitted
        self.matched = buffer[start : start + self._best_len]
        self.stopped = True
        self._pending = ""
        self._ac = None  # the automaton is no longer needed: let it go
        return buffer[:start]
