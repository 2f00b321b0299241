"""StopStrings: cut the text at the first stop string, even when it spans deltas.

Text that could still be the beginning of a stop string is held back until the next
delta decides; so nothing after a stop string ever reaches the client.
"""


class StopStrings:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit; sets `stopped` when a stop string appears."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buffer = self._pending + text
        hits = [(i, s) for s in self.stops if (i := buffer.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)
            self.stopped = True
            self._pending = ""
            return buffer[:at]
        keep = self._held_back(buffer)
        self._pending = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _held_back(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best
