"""What a `file_search` puts before the turn it answers, and the citations its reply gets
back: the one way Assistants' runs and Responses do it.

The found chunks go into the turn's own user message, ahead of its text, each numbered
(`[1]`, `[2]`, ...) with its file's name; the model is asked to cite by those numbers. A
reply's `[n]` markers become `file_citation` annotations on their spans; a reply that
cites nothing gets one annotation per file it was given, at its end, so a client still
learns where the answer came from. Keeping the excerpts in the turn's message (not in a
system message at the top) leaves the conversation's earlier tokens as they were: a warm
context computes only the new turn."""

import re

from deployments.retrieval.service import Found

MARKER = re.compile(r"\[(\d{1,2})\]")
LEAD = (
    "Excerpts from the user's files that may help, numbered. Answer from them where they "
    "apply, and cite each one you use by its number in brackets, like [1].\n\n"
)


def with_excerpts(found: list[Found], text: str) -> str:
    """The user's message text with the found chunks before it."""
    if not found:
        return text
    parts = [f"[{i}] ({f.filename})\n{f.text.strip()}" for i, f in enumerate(found, start=1)]
    return LEAD + "\n\n".join(parts) + "\n\nThe user's message:\n" + text


def citations(reply: str, found: list[Found]) -> list[dict]:
    """OpenAI's `file_citation` annotations of `reply`, in the Assistants shape
    (`{"type", "text", "start_index", "end_index", "file_citation": {"file_id"}}`)."""
    out = []
    for m in MARKER.finditer(reply):
        n = int(m.group(1))
        if 1 <= n <= len(found):
            out.append(
                {
                    "type": "file_citation",
                    "text": m.group(0),
                    "start_index": m.start(),
                    "end_index": m.end(),
                    "file_citation": {"file_id": found[n - 1].file_id},
                }
            )
    if out or not found:
        return out
    end = len(reply)
    files = dict.fromkeys(f.file_id for f in found)
    return [
        {
            "type": "file_citation",
            "text": "",
            "start_index": end,
            "end_index": end,
            "file_citation": {"file_id": file_id},
        }
        for file_id in files
    ]


def response_citations(reply: str, found: list[Found]) -> list[dict]:
    """The same, in the Responses shape (`{"type", "file_id", "filename", "index"}`)."""
    names = {f.file_id: f.filename for f in found}
    return [
        {
            "type": "file_citation",
            "file_id": a["file_citation"]["file_id"],
            "filename": names[a["file_citation"]["file_id"]],
            "index": a["start_index"],
        }
        for a in citations(reply, found)
    ]
