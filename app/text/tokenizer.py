"""Tokenizer and chat template, from transformers, for the same sources as the weights."""

import functools
import inspect
from importlib.resources import files
from typing import Any

from app.models.source import ModelSource
from app.protocol.errors import InvalidRequestError
from app.protocol.messages import PromptEnding, TemplateArgs
from app.text.request_template import RenderJob, render_request_template
from app.text.transformers_tokenizer import load_transformers_tokenizer

# For ChatML models whose own template has no tools (SmolLM2): Hermes-style tool calls.
CHATML_TOOLS_TEMPLATE = (files("app.text.templates") / "chatml_tools.jinja").read_text()


def load_tokenizer(source: ModelSource, chat_template: str | None = None) -> Any:
    """The model's tokenizer; `chat_template` (the model's configured override) replaces
    its own template. A GGUF's is transformers' own, converted on first use and kept
    (app.text.light_tokenizer): reading and converting its vocabulary at every start
    took seconds (3.8 s for SmolLM2's, against 0.2 s to load the kept one)."""
    if source.is_gguf:
        from app.text.light_tokenizer import load_light_tokenizer

        return load_light_tokenizer(source, chat_template)
    return load_transformers_tokenizer(source, chat_template)


def tools_template(tokenizer: Any) -> str | None:
    """The template that renders tools for this model: its own when it takes them,
    Shoal's ChatML tools template when its own is ChatML without them, else None."""
    own = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(own, str):  # several named templates: the one for tools, if any
        own = own.get("tool_use") or own.get("default") or ""
    if "tools" in own:
        return own
    if "<|im_start|>" in own:
        return CHATML_TOOLS_TEMPLATE
    return None


def chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    ending: PromptEnding = "reply",
    args: TemplateArgs | None = None,
) -> str:
    """The prompt's text under the model's chat template, ending as `ending` says; with
    `tools` (or earlier calls and tool results in `messages`), under the template that
    renders them. `args`: the request's own template (rendered apart, bounded) and
    more variables for the template."""
    args = args or TemplateArgs()
    variables = _checked_variables(args.variables)
    if args.template is not None:
        # As apply_chat_template gives them: the special tokens, then the request's.
        special = dict(tokenizer.special_tokens_map)
        job = RenderJob(args.template, messages, tools, ending, {**special, **variables})
        return render_request_template(job)
    template = None
    if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        template = tools_template(tokenizer)
        if template is None:
            raise InvalidRequestError(
                "this model's chat template does not render tools or tool results", "tools"
            )
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=template,
        add_generation_prompt=ending == "reply",
        continue_final_message=ending == "continue",
        tokenize=False,
        **variables,
    )


def chat_token_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    ending: PromptEnding = "reply",
    args: TemplateArgs | None = None,
) -> list[int]:
    """The prompt's token ids: `chat_prompt`'s text, encoded as transformers does for a
    rendered template (its special tokens are in the text, so none are added)."""
    text = chat_prompt(tokenizer, messages, tools, ending, args)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _checked_variables(variables: dict[str, Any]) -> dict[str, Any]:
    """A request's template variables, none of them one the render sets itself (they
    would change how it runs: `tokenize`, `return_tensors`, ...)."""
    taken = sorted(set(variables) & _reserved_names())
    if taken:
        raise InvalidRequestError(
            f"chat_template_kwargs: {', '.join(taken)} cannot be set here", "chat_template_kwargs"
        )
    return variables


@functools.cache
def _reserved_names() -> frozenset[str]:
    from transformers import PreTrainedTokenizerBase
    from transformers.utils.chat_template_utils import render_jinja_template

    names = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    names |= set(inspect.signature(render_jinja_template).parameters)
    return frozenset(names - {"self", "kwargs"} | {"messages"})
