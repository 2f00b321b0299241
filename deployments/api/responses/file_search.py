"""The Responses API's `file_search` tool: the turn searches the tool's vector stores
with its user message (deployments/retrieval, as Assistants' runs do), the chunks go into
that message ahead of its text, and the response gets a `file_search_call` output item
(its results when `include` asks for `file_search_call.results`) and `file_citation`
annotations on its text.

The search always runs when the tool is given: the small models served here do not
decide reliably when to call it, and a turn that brings file_search means to use it."""

import uuid
from dataclasses import dataclass
from typing import Any

from deployments.http.caller import Caller
from deployments.retrieval.excerpts import response_citations, with_excerpts
from deployments.retrieval.service import Found, retrieval_needed

RESULTS_INCLUDE = "file_search_call.results"
DEFAULT_RESULTS = 5  # this server's models read a few chunks well, not OpenAI's 10-50


@dataclass
class Searched:
    """What a turn's file search found, and its output item."""

    item: dict[str, Any]
    found: list[Found]

    def annotate(self, output: list[dict]) -> list[dict]:
        """The search's item first, and citations on every text the output has."""
        out = output if output and output[0]["type"] == "file_search_call" else [self.item, *output]
        for item in out:
            if item["type"] == "message":
                for part in item["content"]:
                    part["annotations"] = response_citations(part["text"], self.found)
        return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def turn_message(messages: list[dict]) -> dict | None:
    """The last user message of `messages`: the one a search is for (None: none)."""
    return next((m for m in reversed(messages) if m.get("role") == "user"), None)


async def search_turn(
    retrieval: Any, tool: Any, messages: list[dict], include: list[str] | None, who: Caller
) -> Searched | None:
    """Search for the last user message of `messages` (the turn's own), and put what was
    found into it (in place: the stored turn, or its conversation's item, keeps what the
    model was shown, so the next turn renders the same history and its context extends).
    None: the turn brings no user message (function outputs), nothing new to search for;
    what earlier turns found is in the context still."""
    retrieval = retrieval_needed(retrieval)
    await retrieval.usable(tool.vector_store_ids, who)
    message = turn_message(messages)
    if message is None:
        return None
    query = _text(message["content"])
    ranking = tool.ranking_options
    found = await retrieval.search(
        tool.vector_store_ids,
        query,
        tool.max_num_results or DEFAULT_RESULTS,
        threshold=ranking.score_threshold if ranking else 0.0,
        hybrid=ranking is None or ranking.ranker != "none",
        filters=tool.filters,
    )
    text, content = with_excerpts(found, query), message["content"]
    images = [] if isinstance(content, str) else [p for p in content if p.get("type") == "image"]
    message["content"] = [{"type": "text", "text": text}, *images] if images else text
    results = None
    if RESULTS_INCLUDE in (include or []):
        results = [
            {
                "file_id": f.file_id,
                "filename": f.filename,
                "score": f.score,
                "text": f.text,
                "attributes": f.attributes,
            }
            for f in found
        ]
    item = {
        "id": f"fs_{uuid.uuid4().hex}",
        "type": "file_search_call",
        "status": "completed",
        "queries": [query],
        "results": results,
    }
    return Searched(item, found)


def search_events(searched: Searched, index: int) -> list[dict]:
    """The item's stream events, as OpenAI's: added, in progress, searching, completed,
    done."""
    item_id = searched.item["id"]
    opened = {**searched.item, "status": "in_progress", "results": None}
    events: list[dict] = [{"type": "response.output_item.added", "item": opened}]
    for phase in ("in_progress", "searching", "completed"):
        events.append({"type": f"response.file_search_call.{phase}", "item_id": item_id})
    events.append({"type": "response.output_item.done", "item": searched.item})
    return [{**e, "output_index": index} for e in events]
