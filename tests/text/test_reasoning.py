"""Thinking split from the answer by a family's markers, whole and streamed in any
chunking, on outputs of the shapes real reasoning models write."""

from hypothesis import given
from hypothesis import strategies as st

from app.text.reasoning import REASONING_FORMATS, ReasoningStream, split_reasoning

QWEN3 = REASONING_FORMATS["qwen3"]
R1 = REASONING_FORMATS["deepseek_r1"]

# Shapes of real outputs: Qwen3 with thinking on, Qwen3 with it off (its template
# writes an empty block), DeepSeek-R1 (the prompt opened the block), cut off mid-thought,
# and a model that did not think at all.
CASES = [
    (
        QWEN3,
        "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
        "\nThe user greets me.\n",
        "Hello! How can I help?",
    ),
    (QWEN3, "<think>\n\n</think>\n\nParis.", "\n\n", "Paris."),
    (R1, "Okay, 2+2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2+2 is 4.\n", "The answer is 4."),
    (QWEN3, "<think>\nLet me count: 1, 2, 3", "\nLet me count: 1, 2, 3", ""),
    (QWEN3, "  Just an answer < with a less-than.", None, "  Just an answer < with a less-than."),
    (QWEN3, "", None, ""),
]


def test_whole_outputs_split():
    for fmt, text, thinking, answer in CASES:
        assert split_reasoning(fmt, text) == (thinking, answer), text


@given(st.data())
def test_any_chunking_streams_the_same_split(data):
    fmt, text, thinking, answer = data.draw(st.sampled_from(CASES))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = ReasoningStream(fmt)
    got_thinking, got_answer = "", ""
    for i, piece in enumerate(pieces):
        t, a = stream.feed(piece, final=i == len(pieces) - 1)
        got_thinking += t
        got_answer += a
    assert (got_thinking if stream.reasoned else None, got_answer) == (thinking, answer)


def test_a_marker_split_across_chunks_is_held_back_not_leaked():
    stream = ReasoningStream(QWEN3)
    assert stream.feed("<thi") == ("", "")  # may be the opening marker
    assert stream.feed("nk>Hmm</th") == ("Hmm", "")  # "</th" may close it
    assert stream.feed("ink>\n\nYes", final=True) == ("", "Yes")
