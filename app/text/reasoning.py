"""A reasoning model's thinking, split from its answer by the family's markers.

Reasoning models (Qwen3, DeepSeek-R1, QwQ...) write their thinking between markers
(`<think>` ... `</think>`) before the answer. APIs hand it back apart: OpenAI-style
`reasoning_content`, Ollama's `message.thinking`, Anthropic's thinking blocks. Some
templates open the block in the prompt (DeepSeek-R1's ends with `<think>\\n`), so the
output starts inside it with no opening marker: `starts_inside`.

`split_reasoning` reads a whole output; `ReasoningStream` reads one as it streams,
holding back only what may be the start of a marker. Which format a request's output
has is decided once per request: the model's parser (configured, or found in its chat
template), then the rendered prompt's end (`for_prompt`): a template may open the block
(DeepSeek-R1, Qwen3's thinking models), or open and close it to turn thinking off
(Qwen3 with `enable_thinking: false`), whatever the family usually does.
"""

from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True)
class ReasoningFormat:
    start: str = "<think>"
    end: str = "</think>"
    starts_inside: bool = False  # the prompt opened the block: the output begins in it

    def for_prompt(self, prompt_tail: str) -> "ReasoningFormat":
        """This format for an output that follows `prompt_tail` (the prompt's last text):
        inside a block when the prompt left one open, before any when the prompt ended
        by closing one; the family's own habit when the prompt's end has neither."""
        opened, closed = prompt_tail.rfind(self.start), prompt_tail.rfind(self.end)
        if opened > closed:
            return replace(self, starts_inside=True)
        if closed >= 0 and prompt_tail.rstrip().endswith(self.end):
            return replace(self, starts_inside=False)
        return self


# By the names a model's config gives (`reasoning_parser`, as vLLM names them).
REASONING_FORMATS = {
    "qwen3": ReasoningFormat(),
    "deepseek_r1": ReasoningFormat(starts_inside=True),
}
REASONING_PARSERS = ("auto", "none", *REASONING_FORMATS)


def template_format(chat_template: str | None) -> ReasoningFormat | None:
    """`reasoning_parser: auto`: the markers a chat template shows its model writes, or
    None. Where the output starts is the prompt's business (`for_prompt`)."""
    fmt = REASONING_FORMATS["qwen3"]
    return fmt if chat_template and fmt.start in chat_template else None


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str]:
    """(thinking, answer) of a whole output; thinking is None when there was none. An
    output cut off inside its thinking is all thinking, with no answer yet."""
    stream = ReasoningStream(fmt)
    thinking, answer = stream.feed(text, final=True)
    return (thinking if stream.reasoned else None), answer


class ReasoningStream:
    """Feed the output's text as it comes; each call returns the (thinking, answer) text
    that can be released so far."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.state: Literal["before", "inside", "after"] = (
            "inside" if fmt.starts_inside else "before"
        )
        self.reasoned = fmt.starts_inside  # a thinking block was opened
        self._held = ""
        self._answer_started = False
        self._thought = False  # some thinking was released

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        thinking, answer = "", ""
        self._held += text
        if self.state == "before":
            lead = self._held.lstrip()
            if lead.startswith(self.fmt.start):
                self._held = lead[len(self.fmt.start) :]
                self.state, self.reasoned = "inside", True
            elif lead and self.fmt.start.startswith(lead) and not final:
                return "", ""  # may be the opening marker, still arriving
            elif lead or final:
                self.state = "after"  # no thinking: the output is all answer
        if self.state == "inside" and not self._thought:
            # A model may open the block its prompt already opened (R1's often do): that
            # marker is no thinking. Held until the first text shows whether it comes.
            lead = self._held.lstrip()
            if not final and self.fmt.start.startswith(lead):
                return "", ""
            if lead.startswith(self.fmt.start):
                self._held = lead[len(self.fmt.start) :]
        if self.state == "inside":
            end = self._held.find(self.fmt.end)
            if end >= 0:
                thinking = self._held[:end]
                self._held = self._held[end + len(self.fmt.end) :]
                self.state = "after"
            else:
                keep = 0 if final else _partial_suffix(self._held, self.fmt.end)
                thinking = self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
            self._thought = self._thought or bool(thinking)
        if self.state == "after":
            answer, self._held = self._held, ""
            if not self._answer_started and self.reasoned:
                answer = answer.lstrip()  # the blank lines after the closing marker
            self._answer_started = self._answer_started or bool(answer)
        return thinking, answer


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
