"""A streamed output's tool calls: what the stream sends is exactly what a parse of the
whole output gives, however the output is cut into pieces (also cut off mid-call), and
each piece costs what it adds (not a re-parse of everything so far)."""

import random
import sys
from pathlib import Path

import pytest

from app.text.tool_calls import ToolFormat, parse
from app.text.tool_stream import ToolCallStream
from tests.text.test_tool_calls import CASES

ARGS = '{"city": "Paris", "days": [1, 2], "note": "a \\"quoted\\" word, and } ]"}'
MORE = [
    (ToolFormat.HERMES, f'Sure.\n<tool_call>\n{{"name": "f", "arguments": {ARGS}}}\n</tool_call>'),
    (ToolFormat.HERMES, '<tool_call>\n{"name": "f"}\n</tool_call>\n<tool_call>{"name": "g", '),
    (ToolFormat.LLAMA3_JSON, f' <|python_tag|> {{"parameters": {ARGS}, "name": "f"}} ; '),
    (ToolFormat.LLAMA3_JSON, '{"answer": 4}'),  # JSON that is no call: content
    (ToolFormat.MISTRAL, f'[TOOL_CALLS] [{{\'x\': 1}}, {{"name": "f", "arguments": {ARGS}}}]'),
    (ToolFormat.MISTRAL, f"Hm [TOOL_CALLS]f[ARGS]{ARGS}[TOOL_CALLS]g[TOOL_CALLS]h[ARGS] 12"),
    (ToolFormat.HERMES, "Nothing to call here, just <b>text</b> and a <tool"),
]
OUTPUTS = [(fmt, text) for fmt, text, _, _ in CASES] + MORE


def streamed(fmt: ToolFormat, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    stream = ToolCallStream(fmt)
    content, names, args = "", {}, {}
    for n, piece in enumerate(pieces):
        new, fragments = stream.feed(piece, final=n == len(pieces) - 1)
        content += new
        for f in fragments:
            if f.id is not None:
                assert f.index == len(names)  # one header a call, in order
                names[f.index] = f.name
            args[f.index] = args.get(f.index, "") + f.arguments
    whole = [c.arguments for _, c in stream.complete_calls()]
    assert whole == [args[i] for i in range(len(whole))]
    return content, [(names[i], args[i]) for i in sorted(names)]


@pytest.mark.parametrize("cut", [1.0, 0.8, 0.5, 0.3])
@pytest.mark.parametrize("fmt, text", OUTPUTS)
def test_streamed_is_exactly_the_whole_parse(fmt, text, cut):
    text = text[: int(len(text) * cut)]  # also outputs cut off mid-call (max_tokens)
    whole = parse(fmt, text, final=True)
    expected = (whole.content, [(c.name, c.arguments) for c in whole.calls])
    rng = random.Random(f"{fmt}{cut}{text}")
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(fmt, [*pieces, ""] if rng.random() < 0.3 else pieces) == expected
    assert streamed(fmt, list(text)) == expected


def _lines_run(fmt: ToolFormat, pieces: list[str]) -> int:
    """Python lines run in app/text while `pieces` stream: the parse's work, counted."""
    here, count = str(Path("app/text").resolve()), [0]

    def local(frame, event, arg):  # noqa: ANN001, ANN202
        count[0] += event == "line"
        return local

    def tracer(frame, event, arg):  # noqa: ANN001, ANN202
        return local if frame.f_code.co_filename.startswith(here) else None

    stream = ToolCallStream(fmt)
    sys.settrace(tracer)
    try:
        for n, piece in enumerate(pieces):
            stream.feed(piece, final=n == len(pieces) - 1)
    finally:
        sys.settrace(None)
    return count[0]


@pytest.mark.parametrize(
    "fmt, head, tail",
    [
        (ToolFormat.HERMES, '<tool_call>\n{"name": "f", "arguments": {', '"z": 0}}\n</tool_call>'),
        (ToolFormat.LLAMA3_JSON, '{"name": "f", "parameters": {', '"z": 0}}'),
        (ToolFormat.MISTRAL, "[TOOL_CALLS]f[ARGS]{", '"z": 0}'),
    ],
)
def test_each_piece_costs_what_it_adds(fmt, head, tail):
    """Twice the argument pieces, about twice the work (a re-parse of the text so far on
    every piece made it four times)."""

    def work(n: int) -> int:
        return _lines_run(fmt, [head, *(f'"k{i:04}": "v", ' for i in range(n)), tail])

    small, large = work(150), work(300)
    assert large < 2.5 * small, (small, large)
