"""A run's output as it streams (Reply): the text of its reply message and, with function
tools, the calls read out of it, each with its events as the SDK's AssistantEventHandler
reads them.

Function tools are shown to the model and constrained as chat completions does
(deployments/http/chat_turn.py): `tool_choice` "required" or a named function forces a
call under the tools' grammar, "auto" lets the model decide. Without function tools the
reply message is made before the first token (a cancelled run still shows what it
wrote); with them, at the first text that is not a call, and a `tool_calls` step at the
first call: its `thread.run.step.delta` events carry the calls as they stream
(`on_tool_call_created`, then `on_tool_call_done` at `thread.run.requires_action`).

A call forced by `tool_choice` is forced once: the generation after its outputs responds
to the user (`shown_tools`), so a run ends in a message rather than asking for the same
call again; with "auto" the model decides each time.
"""

import json
from typing import Any

from app.text.tool_calls import ToolFormat
from app.text.tool_stream import CallFragment, ToolCallStream
from deployments.api.assistants.run_store import RunStore
from deployments.http.chat_turn import ToolName


def shown_tools(run: dict, continuing: bool) -> tuple[list[dict] | None, str | ToolName]:
    """The run's functions as chat templates take them (None: the model is shown none)
    and the ChatTurn's tool_choice. A call the run's tool_choice forces ("required", a
    named function) is forced once: the generation after its outputs responds to the
    user, and may call nothing (OpenAI's "must call one or more tools before responding
    to the user"; a small model free to call again calls again). The functions stay in
    the prompt whatever the choice: the thread's context then extends by the new turn
    alone, where showing and hiding them would change its head, and recompute it all."""
    choice = run.get("tool_choice") or "auto"
    forced = choice == "required" or (isinstance(choice, dict) and choice["type"] == "function")
    functions = [t for t in run["tools"] if t["type"] == "function"]
    if not functions:
        return None, "auto"
    shown = [{"type": "function", "function": t["function"]} for t in functions]
    if choice == "none" or (forced and continuing):
        return shown, "none"
    if continuing or not forced:
        return shown, "auto"
    if choice == "required":
        return shown, "required"
    return shown, ToolName(choice["function"]["name"])


class Reply:
    def __init__(self, runs: RunStore, run: dict, emit: Any, fmt: ToolFormat | None) -> None:
        self.runs, self.run, self.emit = runs, run, emit
        self.calls = None if fmt is None else ToolCallStream(fmt)
        self.text = ""  # the reply message's (with calls: the text before them)
        self.message: dict | None = None
        self.step: dict | None = None  # the tool_calls step, from the first call on

    async def open(self) -> None:
        """The reply message (in progress) and its step, once, and their events."""
        if self.message is not None:
            return
        self.message, step = await self.runs.start_reply(self.run)
        self.emit("thread.run.step.created", step)
        self.emit("thread.run.step.in_progress", step)
        self.emit("thread.message.created", self.message)
        self.emit("thread.message.in_progress", self.message)

    async def feed(self, piece: str, final: bool) -> None:
        """The output's next text; `final`: the output ended with it."""
        if self.calls is None:
            content, fragments = piece, []
        else:
            content, fragments = self.calls.feed(piece, final)
        if content:
            await self.open()
            assert self.message is not None
            self.text += content
            part = {"index": 0, "type": "text", "text": {"value": content, "annotations": []}}
            delta = {"id": self.message["id"], "object": "thread.message.delta"}
            self.emit("thread.message.delta", delta | {"delta": {"content": [part]}})
        if fragments:
            if self.step is None:
                self.step = await self.runs.tools.tool_step(self.run, [], done=False)
                self.emit("thread.run.step.created", self.step)
                self.emit("thread.run.step.in_progress", self.step)
            calls = [_fragment(f) for f in fragments]
            delta = {"step_details": {"type": "tool_calls", "tool_calls": calls}}
            self.emit(
                "thread.run.step.delta",
                {"id": self.step["id"], "object": "thread.run.step.delta", "delta": delta},
            )

    def tool_calls(self) -> list[dict]:
        """The whole calls, as the step shows them (no output yet)."""
        if self.calls is None:
            return []
        return [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments, "output": None},
            }
            for call_id, c in self.calls.complete_calls()
        ]

    def turn(self, calls: list[dict]) -> dict:
        """The calls as the assistant's turn of the chat template (arguments as objects),
        which the run's next generation continues from."""
        return {
            "role": "assistant",
            "content": self.text,
            "tool_calls": [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": _arguments(c["function"]["arguments"]),
                    },
                }
                for c in calls
            ],
        }


def required_action(calls: list[dict]) -> dict:
    asked = [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
        }
        for c in calls
    ]
    return {"type": "submit_tool_outputs", "submit_tool_outputs": {"tool_calls": asked}}


def _fragment(f: CallFragment) -> dict:
    """A call's delta as the SDK accumulates it: id, type and name first, then argument
    pieces under the same index (each with its type: the SDK's union is told by it)."""
    if f.id is None:
        return {"index": f.index, "type": "function", "function": {"arguments": f.arguments}}
    function = {"name": f.name, "arguments": f.arguments, "output": None}
    return {"index": f.index, "id": f.id, "type": "function", "function": function}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # an unconstrained call the model wrote badly
        return text
