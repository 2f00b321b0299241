"""A response streamed as the Responses API's typed events, numbered in order:
response.created, response.in_progress, then per output item (a reasoning model's
thinking, the assistant's text, each function call) its added / delta / done events, then response.completed (or
response.incomplete, cut by max_output_tokens). A failure after the first token ends the
stream with an `error` event."""

import uuid
from collections.abc import AsyncIterator

from app.protocol.errors import ShoalError
from app.text.tool_stream import CallFragment, ToolCallStream
from deployments.api.responses.file_search import search_events
from deployments.api.responses.store import ResponseStore
from deployments.api.responses.turn import Turn, call_item, message_item, reasoning_item
from deployments.http.generation import Generation


def error_event(exc: ShoalError) -> dict:
    return {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param}


class _Items:
    """The output items so far, and the events that open, feed and close them."""

    def __init__(self) -> None:
        self.done: list[dict] = []
        self.open: dict | None = None  # the item being streamed
        self.text = ""  # the open message's (or reasoning item's) text

    @property
    def index(self) -> int:
        return len(self.done)

    def thinking_delta(self, piece: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self.close()
            self.open, self.text = reasoning_item("", "in_progress"), ""
            part = {"type": "reasoning_text", "text": ""}
            item = {**self.open, "content": []}
            events.append(self._at({"type": "response.output_item.added", "item": item}))
            events.append(self._part("response.content_part.added", part))
        self.text += piece
        events.append(self._part("response.reasoning_text.delta", None, delta=piece))
        return events

    def text_delta(self, piece: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self.close()
            self.open, self.text = message_item("", "in_progress", f"msg_{uuid.uuid4().hex}"), ""
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {**self.open, "content": []}
            events.append(self._at({"type": "response.output_item.added", "item": item}))
            events.append(self._part("response.content_part.added", part))
        self.text += piece
        events.append(self._part("response.output_text.delta", None, delta=piece, logprobs=[]))
        return events

    def call(self, fragment: CallFragment) -> list[dict]:
        events = []
        if fragment.id is not None:
            events += self.close()
            self.open = call_item(fragment.id, fragment.name or "", "", "in_progress")
            events.append(self._at({"type": "response.output_item.added", "item": dict(self.open)}))
        if fragment.arguments and self.open is not None:
            self.open["arguments"] += fragment.arguments
            events.append(
                self._at(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self.open["id"],
                        "delta": fragment.arguments,
                    }
                )
            )
        return events

    def close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        events = []
        if item["type"] == "reasoning":
            item = reasoning_item(self.text, "completed", item["id"])
            part = item["content"][0]
            events.append(self._part("response.reasoning_text.done", None, item, text=self.text))
            events.append(self._part("response.content_part.done", part, item))
        elif item["type"] == "message":
            item = message_item(self.text, "completed", item["id"])
            part = item["content"][0]
            events.append(
                self._part("response.output_text.done", None, item, text=self.text, logprobs=[])
            )
            events.append(self._part("response.content_part.done", part, item))
        else:
            item["status"] = "completed"
            events.append(
                self._at(
                    {
                        "type": "response.function_call_arguments.done",
                        "item_id": item["id"],
                        "arguments": item["arguments"],
                    }
                )
            )
        events.append(self._at({"type": "response.output_item.done", "item": item}))
        self.done.append(item)
        return events

    def _at(self, event: dict) -> dict:
        # An item's events all come before it is done: its place is the count done.
        return {**event, "output_index": self.index}

    def _part(self, kind: str, part: dict | None, item: dict | None = None, **fields) -> dict:  # noqa: ANN003
        item_id = (item or self.open or {}).get("id")
        event = {"type": kind, "item_id": item_id, "content_index": 0, **fields}
        if part is not None:
            event["part"] = part
        return self._at(event)


async def response_events(turn: Turn, gen: Generation, store: ResponseStore) -> AsyncIterator[dict]:
    sequence = 0

    def numbered(event: dict) -> dict:
        nonlocal sequence
        sequence += 1
        return {**event, "sequence_number": sequence - 1}

    yield numbered({"type": "response.created", "response": turn.body("in_progress", [], None)})
    yield numbered({"type": "response.in_progress", "response": turn.body("in_progress", [], None)})
    items = _Items()
    if turn.searched is not None:  # searched before the first token: its item is first
        for event in search_events(turn.searched, items.index):
            yield numbered(event)
        items.done.append(turn.searched.item)
    calls = ToolCallStream(turn.fmt) if turn.fmt is not None else None
    try:
        async for d in gen.deltas():
            text, fragments = d.text, []
            if calls is not None:
                text, fragments = calls.feed(d.text, final=d.finish_reason is not None)
            events = items.thinking_delta(d.thinking) if d.thinking else []
            events += items.text_delta(text) if text else []
            for fragment in fragments:
                events += items.call(fragment)
            for event in events:
                yield numbered(event)
    except ShoalError as exc:
        yield numbered(error_event(exc))
        return
    if not items.done and items.open is None:  # an empty reply is one empty message
        for event in items.text_delta(""):
            yield numbered(event)
    for event in items.close():
        yield numbered(event)
    body = await turn.finish(store, items.done, gen)
    kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
    yield numbered({"type": kind, "response": body})
