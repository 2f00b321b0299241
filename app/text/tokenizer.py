"""Tokenizer and chat template, from transformers, for the same sources as the weights."""

import functools
import inspect
from importlib.resources import files
from typing import Any

from app.models.source import ModelSource
from app.protocol.errors import InvalidRequestError
from app.protocol.messages import PromptEnding, TemplateArgs
from app.text.render_pool import Sandbox, default_pool
from app.text.request_template import RenderJob, too_many_tokens
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
    sandbox: Sandbox | None = None,
) -> str:
    """The prompt's text under the model's chat template, ending as `ending` says; with
    `tools` (or earlier calls and tool results in `messages`), under the template that
    renders them. `args`: the request's own template and more variables for the
    template. A request's template renders in `sandbox` (the process's default pool when
    None), and so does the model's own where `sandbox.model_template` says (a model
    downloaded at run time): apart and bounded (app/text/request_template.py)."""
    text, bound = _rendered(tokenizer, messages, tools, ending, args, sandbox)
    if bound is not None:
        _bounded(tokenizer(text, add_special_tokens=False).input_ids, bound, args)
    return text


def chat_token_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    ending: PromptEnding = "reply",
    args: TemplateArgs | None = None,
    sandbox: Sandbox | None = None,
) -> list[int]:
    """The prompt's token ids: `chat_prompt`'s text, encoded as transformers does for a
    rendered template (its special tokens are in the text, so none are added). A
    sandboxed render's text was bounded to the model's context where it was rendered;
    its ids are checked again here (the bound in characters is all a worker can apply
    for a tokenizer without a Rust backend)."""
    text, bound = _rendered(tokenizer, messages, tools, ending, args, sandbox)
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    return ids if bound is None else _bounded(ids, bound, args)


def _bounded(ids: list[int], bound: int, args: TemplateArgs | None) -> list[int]:
    if len(ids) > bound:
        own = args is not None and args.template is not None
        raise InvalidRequestError(
            too_many_tokens(len(ids), bound), "chat_template" if own else "messages"
        )
    return ids


def _rendered(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    ending: PromptEnding,
    args: TemplateArgs | None,
    sandbox: Sandbox | None,
) -> tuple[str, int | None]:
    """The prompt's text, and the most tokens it may have when it was rendered apart."""
    args = args or TemplateArgs()
    variables = _checked_variables(args.variables)
    template = args.template
    own = template is not None
    if not own and (tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)):
        template = tools_template(tokenizer)
        if template is None:
            raise InvalidRequestError(
                "this model's chat template does not render tools or tool results", "tools"
            )
    if not own and (sandbox is None or not sandbox.model_template):
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            add_generation_prompt=ending == "reply",
            continue_final_message=ending == "continue",
            tokenize=False,
            **variables,
        )
        return text, None
    sandbox = sandbox or Sandbox(default_pool())
    if not own:  # the model's own: by name, when it has several (as transformers picks)
        template = tokenizer.get_chat_template(template, tools)
    # As apply_chat_template gives them: the messages without their None values, the
    # special tokens, then the request's variables.
    present = [{k: v for k, v in m.items() if v is not None} for m in messages]
    special = dict(tokenizer.special_tokens_map)
    job = RenderJob(template, present, tools, ending, {**special, **variables})
    param = "chat_template" if own else "messages"
    text = sandbox.pool.render(job, tokenizer, sandbox.limits, param)
    return text, sandbox.limits.max_prompt_tokens


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
