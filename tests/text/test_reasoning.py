"""Thinking split from the answer by a family's markers, whole and streamed in any
chunking, on outputs of the shapes real reasoning models write; where an output starts
(inside the thinking or before it) as the prompt's end says; and a constraint that
governs the answer only, checked token by token on a real vocabulary."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.protocol.sampling import Constraint
from app.text.reasoning import REASONING_FORMATS, ReasoningStream, split_reasoning
from app.text.reasoning import template_format as format_of
from app.text.reasoning_grammar import thinking_first
from app.text.tool_calls import ToolFormat
from app.text.tool_stream import whole_output

QWEN3 = REASONING_FORMATS["qwen3"]
R1 = REASONING_FORMATS["deepseek_r1"]

# Outputs in the shapes these models write them (their own turns of phrase, markers and
# blank lines): Qwen3 thinking, then a bold answer; Qwen3 thinking, then a Hermes tool
# call; Qwen3 with /no_think (its template's empty block is in the output when the user
# turns thinking off in the message); a DeepSeek-R1 distill under its template (which
# opened the block: no opening marker); DeepSeek-R1 under an older template (the model
# opens the block itself); QwQ cut off by max_tokens mid-thought.
QWEN3_MATH = (
    "<think>\nOkay, the user is asking what 2 plus 2 equals. That's basic arithmetic: "
    "2 plus 2 is 4. I should answer directly.\n</think>\n\n2 + 2 equals **4**."
)
QWEN3_CALL = (
    "<think>\nThe user wants the weather in Paris. I have a get_weather tool that takes "
    'a city, so I\'ll call it with "Paris".\n</think>\n\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
R1_DISTILL = (
    "Okay, so I need to find 15% of 80. Let me think. 10% of 80 is 8, and 5% is half "
    "of that, which is 4. So 8 + 4 = 12.\n</think>\n\n15% of 80 is **12**."
)
R1_OWN_OPENING = "<think>\nHmm, the user just said hello.\n</think>\n\nHello! How can I help?"
QWQ_CUT = "Alright, let's tackle this step by step. First, I need to recall how"

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
    (
        QWEN3,
        QWEN3_MATH,
        "\nOkay, the user is asking what 2 plus 2 equals. That's basic arithmetic: 2 plus 2 "
        "is 4. I should answer directly.\n",
        "2 + 2 equals **4**.",
    ),
    (
        QWEN3,
        QWEN3_CALL,
        "\nThe user wants the weather in Paris. I have a get_weather tool that takes a city, "
        'so I\'ll call it with "Paris".\n',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ),
    (
        R1,
        R1_DISTILL,
        "Okay, so I need to find 15% of 80. Let me think. 10% of 80 is 8, and 5% is half of "
        "that, which is 4. So 8 + 4 = 12.\n",
        "15% of 80 is **12**.",
    ),
    (R1, R1_OWN_OPENING, "\nHmm, the user just said hello.\n", "Hello! How can I help?"),
    (R1, QWQ_CUT, QWQ_CUT, ""),
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


def test_a_call_after_thinking_is_read_from_the_answer_alone():
    """The thinking mentions the tool and its argument; only the answer's call counts."""
    _, answer = split_reasoning(QWEN3, QWEN3_CALL)
    content, calls = whole_output(ToolFormat.HERMES, answer)
    assert not content and [(c.name, c.arguments) for _, c in calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]


# The end of a Qwen3-style generation prompt, thinking on (a thinking model's template
# opens the block) and off (the template writes an empty one); R1's opens it always.
OPENED = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
CLOSED = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
PLAIN = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_the_prompts_end_says_where_the_output_starts():
    assert QWEN3.for_prompt(OPENED).starts_inside
    assert not QWEN3.for_prompt(CLOSED).starts_inside
    assert not QWEN3.for_prompt(PLAIN).starts_inside  # the family's habit
    assert R1.for_prompt(PLAIN).starts_inside
    assert not R1.for_prompt(CLOSED).starts_inside  # thinking turned off by the template
    # A prefill that opened the block and began thinking: the output goes on inside it.
    assert QWEN3.for_prompt(OPENED + "Let me see").starts_inside
    # An earlier turn's closed block, then a fresh generation prompt: the family's habit.
    earlier = "<|im_start|>assistant\n<think>\nx\n</think>\n\nHello<|im_end|>\n" + PLAIN
    assert not QWEN3.for_prompt(earlier).starts_inside
    assert split_reasoning(QWEN3.for_prompt(OPENED), R1_DISTILL)[1] == "15% of 80 is **12**."


def test_auto_finds_the_markers_in_the_template():
    qwen3_tail = (
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
    )
    assert format_of(qwen3_tail) == QWEN3
    assert format_of("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert format_of(None) is None


@pytest.fixture(scope="module")
def matcher(smollm2_tokenizer):
    """Whether a text is what a constraint allows, token by token, on SmolLM2's vocabulary
    (as the engine's grammar backend reads it)."""
    import llguidance.hf
    from llguidance import LLMatcher

    vocab = llguidance.hf.from_tokenizer(smollm2_tokenizer)

    def accepts(constraint: Constraint, text: str) -> bool:
        m = LLMatcher(vocab, LLMatcher.grammar_from_lark(constraint.spec), log_level=0)
        ids = smollm2_tokenizer(text, add_special_tokens=False).input_ids
        return m.consume_tokens(ids) and m.is_accepting()

    return accepts


def test_a_constraint_governs_the_answer_after_free_thinking(matcher):
    schema = Constraint(kind="json", spec='{"type": "object", "required": ["a"]}')
    regex = Constraint(kind="regex", spec="[0-9]+/[0-9]+")
    choice = Constraint(kind="choice", spec='["yes", "no"]')
    gbnf = Constraint(kind="grammar", spec='root ::= "A" | "B"')
    r1, qwen3 = thinking_first(R1, regex), thinking_first(QWEN3, schema)
    assert matcher(r1, "3 {halves} </th </thin\n</think>\n\n1/2")
    assert matcher(r1, "</think>1/2")  # an empty thought
    assert not matcher(r1, "1/2")  # the prompt opened the block: it must close
    assert not matcher(r1, "x</think>1/2</think>")  # one closing marker, then the answer
    assert not matcher(r1, "x</think>one half")
    assert matcher(qwen3, '<think>\n{"a": 1}?\n</think>\n\n{"a": 1}')
    assert matcher(qwen3, '{"a": 1}')  # no thinking: the family may skip it
    assert not matcher(qwen3, '<think>x</think>{"b": 1}')
    assert matcher(thinking_first(R1, choice), "maybe?</think> no")
    assert matcher(thinking_first(R1, gbnf), "hmm</think>B")


def test_a_constraint_too_large_to_follow_the_thinking_is_the_clients_error():
    """A grammar just under the limit grows past it nested after the thinking: a 400,
    not a validation error (a 500) from the bigger constraint."""
    from app.protocol.errors import InvalidRequestError
    from app.protocol.sampling import MAX_CONSTRAINT_CHARS

    near = Constraint(kind="lark", spec='start: "' + "a" * (MAX_CONSTRAINT_CHARS - 20) + '"\n')
    with pytest.raises(InvalidRequestError, match="too large to follow the thinking"):
        thinking_first(R1, near)
