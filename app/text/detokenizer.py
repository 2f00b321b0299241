"""IncrementalDetokenizer: token ids in, text deltas out, never a broken UTF-8 character.

Decoding token by token is wrong for byte-level BPE (a character can span tokens) and for
SentencePiece (a leading space depends on the previous token). We decode a short window
ending at the new tokens and emit only what the window adds to the text already emitted,
holding back while the decoded text ends in U+FFFD (an incomplete character).
"""

from typing import Any

_CONTEXT = 5  # prompt tokens kept as decoding context


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        # A fast tokenizer's own decoder gives transformers' text when transformers cleans
        # up no spaces, in a third of the time (two decodes per stream message).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans = getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._backend = backend if backend is not None and cleans is False else None

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int] | tuple[int, ...]) -> str:
        """Append tokens; return the newly complete text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a stream: whatever is left, minus a dangling partial character."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :].rstrip("\ufffd")
