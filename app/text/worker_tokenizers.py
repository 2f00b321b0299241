"""The tokenizers the chat template workers count a render's tokens with, by key: a
worker is sent a tokenizer's `tokenizers` JSON once (and again when a new worker
starts) and then only its key with each render (render_pool.py)."""

import threading
import uuid
import weakref
from collections import deque
from typing import Any

from app.text.template_worker import CHILD_TOKENIZERS


class WorkerTokenizers:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # its own: to_str() of a large vocabulary takes a while
        self._keys: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._sources: dict[str, str] = {}
        self._uncounted: set[str] = set()  # tokenizers a worker failed to load
        self._recent: deque[str] = deque(maxlen=CHILD_TOKENIZERS)  # a new worker loads them

    def key(self, tokenizer: Any) -> str | None:
        """The key a worker knows `tokenizer` by; None when it has no Rust backend to
        send (the caller then counts the tokens) or a worker could not load it."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "to_str"):
            return None
        with self._lock:
            try:
                key = self._keys.get(tokenizer)
            except TypeError:  # not weakly referable
                return None
            if key is None:
                key = uuid.uuid4().hex
                self._sources[key] = backend.to_str()
                self._keys[tokenizer] = key
            if key in self._uncounted:
                return None
            if key not in self._recent:
                self._recent.append(key)
            return key

    def source(self, key: str) -> str:
        return self._sources[key]

    def uncountable(self, key: str) -> None:
        """A worker could not load it (too large for its memory): never tried again."""
        with self._lock:
            self._uncounted.add(key)

    def recent(self) -> list[str]:
        """The keys used last, that a new worker loads before its first render."""
        with self._lock:
            return [key for key in self._recent if key not in self._uncounted]
