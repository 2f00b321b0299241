"""Chat templates that are not the operator's, rendered apart and bounded: a request's own
(vLLM's `chat_template`) and the template of a model downloaded and started at run time.

Such a template is someone else's code. transformers renders it in Jinja's immutable
sandbox, which keeps it from Python's internals but not from the CPU or memory:
`{{ 9**9**9 }}` or a macro that calls itself twice runs for hours, `{{ "x" * 10**10 }}`
takes the memory. So it is rendered, by transformers' own renderer (the one
apply_chat_template calls, in the same sandbox), in a worker process (template_child.py)
with an address-space limit, a time limit and a bound on what it writes: at most the
model's context, in characters and then in tokens, counted there by the model's own
tokenizer, so that no more than a context's worth of text ever comes out to be encoded.
A worker that overruns is killed and replaced in the background. Templates from the
operator's config, or packaged with a configured model, render in-process, as before.

The workers: template_worker.py (the process) and render_pool.py (who renders when).
"""

from dataclasses import dataclass
from typing import Any

from app.protocol.errors import CapacityError, InvalidRequestError
from app.protocol.messages import PromptEnding

RENDER_TIMEOUT_S = 3.0
MAX_PROMPT_CHARS = 8 << 20  # the bound when no context is given
# A prompt's characters per token, at most (real text: about 4; long runs of spaces or
# punctuation that one token covers reach a few dozen): the characters a context holds.
MAX_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class RenderJob:
    template: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    ending: PromptEnding
    variables: dict[str, Any]  # the tokenizer's special tokens, then the request's


class RenderersBusyError(CapacityError):
    """The render workers' waiting line is full, in all or for this client: retry later."""

    code = "chat_template_busy"
    retry_after_s = RENDER_TIMEOUT_S


def request_templates_refused() -> InvalidRequestError:
    """The 400 for a request that brings its own chat template to a server that does not
    render them (`trust_request_chat_template` off, the default)."""
    return InvalidRequestError(
        "chat_template: this server does not render a request's own chat template (a "
        "template is code the server would run); its operator can allow them with "
        "`trust_request_chat_template: true` in the app's config. Without it, send the "
        "messages for the model's own template, with chat_template_kwargs if needed",
        "chat_template",
    )


def char_bound(max_tokens: int | None) -> int:
    """The most characters a render may write for a prompt of at most `max_tokens`."""
    if max_tokens is None:
        return MAX_PROMPT_CHARS
    return min(MAX_PROMPT_CHARS, max_tokens * MAX_CHARS_PER_TOKEN)


def too_many_tokens(num_tokens: int, max_tokens: int) -> str:
    return (
        f"chat template failed: it rendered {num_tokens} tokens; the model's context "
        f"holds {max_tokens}"
    )
