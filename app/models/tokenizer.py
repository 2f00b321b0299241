"""Tokenizer and chat template, from transformers, for the same sources as the weights."""

from importlib.resources import files
from typing import Any

from app.models.source import ModelSource
from app.protocol.errors import InvalidRequestError, ModelLoadError
from app.protocol.messages import PromptEnding

# For ChatML models whose own template has no tools (SmolLM2): Hermes-style tool calls.
CHATML_TOOLS_TEMPLATE = (files("app.models.templates") / "chatml_tools.jinja").read_text()


def load_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    try:
        if source.is_gguf:
            return AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
        return AutoTokenizer.from_pretrained(str(source.directory))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(source.name, f"cannot load its tokenizer: {exc}") from exc


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
) -> str:
    """The prompt's text under the model's chat template, ending as `ending` says; with
    `tools` (or earlier calls and tool results in `messages`), under the template that
    renders them."""
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
    )


def chat_token_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    ending: PromptEnding = "reply",
) -> list[int]:
    """The prompt's token ids: `chat_prompt`'s text, encoded as transformers does for a
    rendered template (its special tokens are in the text, so none are added)."""
    text = chat_prompt(tokenizer, messages, tools, ending)
    return list(tokenizer(text, add_special_tokens=False).input_ids)
