"""Internal messages that cross the ingress -> model replica hop (never HTTP objects,
never a dialect's schema). Every call that touches a context carries its `ContextOp`,
which is all a request router needs to read."""

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from app.protocol.errors import InvalidRequestError
from app.protocol.images import ImageInput
from app.protocol.outputs import EngineErrorMessage
from app.protocol.sampling import SamplingParams

__all__ = [
    "ContextAction",
    "ContextOp",
    "EngineErrorMessage",
    "EngineRequest",
    "PromptEnding",
    "RenderLimits",
    "TemplateArgs",
    "context_op",
]

# How a rendered conversation ends: ready for the reply (the template's generation
# prompt), with the last (assistant) message left open for the model to go on with (a
# prefill), or as it is (no generation prompt: vLLM's add_generation_prompt=false).
PromptEnding = Literal["reply", "continue", "none"]

# A request's own chat template is user input run as (sandboxed) code: bounded in size
# here, in time and memory where it is rendered (app/text/request_template.py).
MAX_TEMPLATE_CHARS = 64 * 1024
MAX_TEMPLATE_VARIABLES_CHARS = 64 * 1024  # chat_template_kwargs, as JSON


@dataclass(frozen=True)
class TemplateArgs:
    """What a request adds to its chat template's render: its own template (vLLM's
    `chat_template`; None: the model's) and more variables for it (vLLM's
    `chat_template_kwargs`; Ollama's `think` and Anthropic's `thinking` become
    `enable_thinking`)."""

    template: str | None = None
    variables: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def checked(
        cls, template: str | None, variables: dict[str, Any] | None
    ) -> "TemplateArgs | None":
        """A request's fields (vLLM's names) within bounds; None when it gives neither."""
        if template is None and not variables:
            return None
        if template is not None and len(template) > MAX_TEMPLATE_CHARS:
            raise InvalidRequestError(
                f"chat_template is {len(template)} characters; at most {MAX_TEMPLATE_CHARS}",
                "chat_template",
            )
        size = len(json.dumps(variables or {}, default=str))
        if size > MAX_TEMPLATE_VARIABLES_CHARS:
            raise InvalidRequestError(
                f"chat_template_kwargs is {size} characters of JSON; at most "
                f"{MAX_TEMPLATE_VARIABLES_CHARS}",
                "chat_template_kwargs",
            )
        return cls(template, dict(variables or {}))


@dataclass(frozen=True)
class RenderLimits:
    """For a chat template the Tokenizer renders in its sandbox (a request's own, or one
    that came with a model downloaded at run time): whose render it is (the caller's key
    id or address: the render workers take turns between clients) and the most tokens
    its prompt may have (the model's context; None: only a fixed bound in characters)."""

    client: str = ""
    max_prompt_tokens: int | None = None


class ContextAction(StrEnum):
    FILL = "fill"  # add tokens to a context, sample nothing the client sees
    GENERATE = "generate"  # add tokens, then generate and keep the output in the context
    READ = "read"  # its tokens
    FREE = "free"
    SAVE = "save"  # its tokens and KV to a file
    RESTORE = "restore"  # a context from a file
    MOVE = "move"  # its tokens and KV to another replica

    @property
    def generates(self) -> bool:
        """Whether this action runs as a generation (an EngineRequest); the others are
        plain calls on the replica."""
        return self in (ContextAction.FILL, ContextAction.GENERATE)

    @property
    def creates(self) -> bool:
        """Whether this action may bring the context into being (and so pins it where it
        is sent); the others only find it where it already is."""
        return self in (ContextAction.FILL, ContextAction.GENERATE, ContextAction.RESTORE)


@dataclass(frozen=True)
class ContextOp:
    """What one call does to one context; a child (`parent_context_id`) starts as a fork
    of its parent, in the parent's replica. `expected_tokens`: the context must hold
    exactly this many tokens (0: must not exist), else the call fails with 410 and
    changes nothing; a caller that appends to what it last read never appends to
    something else (a context lost and re-created empty on a restarted replica)."""

    context_id: str
    action: ContextAction
    parent_context_id: str | None = None
    expected_tokens: int | None = None


@dataclass(frozen=True)
class EngineRequest:
    """One generation as the engine takes it."""

    request_id: str
    prompt_token_ids: list[int]  # with `context`: the tokens to add to it
    params: SamplingParams
    context: ContextOp | None = None
    images: tuple[ImageInput, ...] = ()  # in the prompt's spans (processed pixels)
    lora_path: str | None = None  # the directory of the adapter `params.lora` names


def context_op(args: tuple) -> ContextOp | None:
    """The context a replica call names, whatever the method: its ContextOp argument, or
    its EngineRequest's."""
    for arg in args:
        if isinstance(arg, ContextOp):
            return arg
        if isinstance(arg, EngineRequest):
            return arg.context
    return None
