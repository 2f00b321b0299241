"""Items and the chat-template messages they make: a response's output as the next
turn's assistant message, input items as OpenAI lists them, and a conversation's items
(OpenAI's Conversations API) as fragments that fold into the messages of its prompt.

A conversation keeps one fragment per item (deployments/state/conversations.py); `fold`
joins a function call to the assistant turn before it and a turn's thinking to its text,
so a response's output folds into exactly the message `assistant_message` makes of it,
and a conversation renders as the same chain of turns would (which is what lets its warm
context extend instead of rebuilding).
"""

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from app.protocol.errors import InvalidRequestError
from deployments.api.responses.items import (
    TEXT_PARTS,
    FunctionCallItem,
    InputItem,
    ReasoningItem,
    input_items,
)

MAX_NEW_ITEMS = 20  # items one call adds to a conversation, as OpenAI allows
PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


@dataclass
class NewItem:
    """An item on its way into a conversation."""

    item: dict[str, Any]  # the object the API returns, with its id
    message: dict[str, Any]  # its chat-template fragment (see `fold`)


def new_items(raw: Any, param: str) -> list[NewItem]:
    """Up to MAX_NEW_ITEMS client items (for `param`), checked as Responses input items
    are, each with an id of its own: an id the client sent may already name an item."""
    if not isinstance(raw, list):
        raise InvalidRequestError(f"{param} must be a list of items", param)
    if len(raw) > MAX_NEW_ITEMS:
        raise InvalidRequestError(
            f"{param} holds at most {MAX_NEW_ITEMS} items, not {len(raw)}", param
        )
    try:
        return input_new_items(input_items(raw), param)
    except InvalidRequestError as exc:  # said of `input`: say it of `param`
        raise InvalidRequestError(exc.message.replace("input[", f"{param}[", 1), param) from None


def input_new_items(items: list[InputItem], param: str) -> list[NewItem]:
    made = []
    for i, item in enumerate(items):
        item_id = f"{PREFIXES[item.type]}_{uuid.uuid4().hex}"
        listed = listed_item("", i, {**item.model_dump(exclude_unset=True), "id": item_id})
        made.append(NewItem(listed, _fragment(item, f"{param}[{i}]")))
    return made


def output_new_items(output: list[dict[str, Any]]) -> list[NewItem]:
    """A response's output items (their own ids), each as the assistant's fragment."""
    return [NewItem(item, assistant_message([item])) for item in output]


def _fragment(item: InputItem, where: str) -> dict[str, Any]:
    if isinstance(item, ReasoningItem):
        return {"role": "assistant", "content": "", "reasoning_content": item.text()}
    if isinstance(item, FunctionCallItem):
        return {"role": "assistant", "content": "", "tool_calls": [item.call(where)]}
    return item.message()


def fold(fragments: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages the fragments make, in order: an assistant fragment joins the
    assistant message before it when that one holds only thinking, or when it adds only
    calls; anything else starts a message of its own."""
    out: list[dict[str, Any]] = []
    for fragment in fragments:
        last = out[-1] if out else None
        joins = (
            last is not None
            and last["role"] == fragment["role"] == "assistant"
            and (_thinking_only(last) or _calls_only(fragment))
        )
        if joins:
            out[-1] = _join(out[-1], fragment)
        else:
            out.append(dict(fragment))
    return out


def _thinking_only(message: dict[str, Any]) -> bool:
    return not message.get("content") and not message.get("tool_calls")


def _calls_only(message: dict[str, Any]) -> bool:
    return bool(message.get("tool_calls")) and not (
        message.get("content") or message.get("reasoning_content")
    )


def _join(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    # Keys in assistant_message's order: a template that walks them sees the same message.
    joined: dict[str, Any] = {"role": "assistant", "content": a["content"] + b["content"]}
    thinking = a.get("reasoning_content", "") + b.get("reasoning_content", "")
    if thinking:
        joined["reasoning_content"] = thinking
    calls = [*a.get("tool_calls", []), *b.get("tool_calls", [])]
    if calls:
        joined["tool_calls"] = calls
    return joined


def assistant_message(output: list[dict]) -> dict[str, Any]:
    """The output as the chat template renders it in the next turn's prompt (the
    template decides whether to show the thinking)."""
    text = "".join(c["text"] for i in output if i["type"] == "message" for c in i["content"])
    message: dict[str, Any] = {"role": "assistant", "content": text}
    thoughts = [c["text"] for i in output if i["type"] == "reasoning" for c in i["content"]]
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    calls = [i for i in output if i["type"] == "function_call"]
    if calls:
        message["tool_calls"] = [
            {
                "id": c["call_id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": _json_object(c["arguments"])},
            }
            for c in calls
        ]
    return message


def listed_item(response_id: str, index: int, item: dict[str, Any]) -> dict[str, Any]:
    """An input item as OpenAI lists it: an id (the client's, or one made from the
    response's and the item's place, the same on every listing, for `after`), a status,
    and a message's text as input_text parts (output_text for the assistant's)."""
    kind = item.get("type", "message")
    listed = {
        **item,
        "type": kind,
        "id": item.get("id") or f"{PREFIXES[kind]}_{response_id.removeprefix('resp_')}_{index}",
        "status": "completed",
    }
    if kind == "reasoning":
        listed.setdefault("summary", [])
    if kind == "message":
        content = item["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if item["role"] == "assistant":
            listed["content"] = [
                {"type": "output_text", "text": p["text"], "annotations": []} for p in parts
            ]
        else:  # images as they were given
            listed["content"] = [
                {"type": "input_text", "text": p["text"]} if p["type"] in TEXT_PARTS else p
                for p in parts
            ]
    return listed


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {}  # cut off mid-call: templates take arguments as an object
