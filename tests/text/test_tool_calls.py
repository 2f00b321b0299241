"""Tool-call parsing on outputs recorded from the families' own models (their model
cards and chat-template docs), whole and streamed in small pieces."""

import json

import pytest

from app.text.tool_calls import ToolFormat, call_grammar, parse, text_grammar, tool_format
from app.text.tool_stream import ToolCallStream, whole_output

QWEN_TWO_CALLS = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
    '"San Francisco, CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", '
    '"arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>'
)
HERMES_2_PRO = (  # Hermes 2 Pro writes the arguments first
    "Let me look that up.\n<tool_call>\n"
    '{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>'
)
LLAMA_31 = (
    '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
    '"unit": "Fahrenheit"}}'
)
LLAMA_32_TAGGED = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}'
)
MISTRAL_V3 = (
    '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
    '"format": "celsius"}}, {"name": "get_time", "arguments": {}}]'
)
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}'

CASES = [
    (
        ToolFormat.HERMES,
        QWEN_TWO_CALLS,
        None,
        [
            ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
            ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}),
        ],
    ),
    (
        ToolFormat.HERMES,
        HERMES_2_PRO,
        "Let me look that up.",
        [("get_stock_fundamentals", {"symbol": "TSLA"})],
    ),
    (
        ToolFormat.LLAMA3_JSON,
        LLAMA_31,
        None,
        [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
    ),
    (
        ToolFormat.LLAMA3_JSON,
        LLAMA_32_TAGGED,
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})],
    ),
    (
        ToolFormat.MISTRAL,
        MISTRAL_V3,
        None,
        [
            ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
            ("get_time", {}),
        ],
    ),
    (ToolFormat.MISTRAL, MISTRAL_V11, None, [("get_weather", {"city": "Paris", "days": [1, 2]})]),
]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_recorded_outputs_whole(fmt, text, content, calls):
    got_content, got = whole_output(fmt, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for _, c in got] == calls
    assert all(i.startswith("call_") for i, _ in got) and len({i for i, _ in got}) == len(got)


@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_recorded_outputs_streamed(fmt, text, content, calls, size):
    stream = ToolCallStream(fmt)
    sent, names, args = "", {}, {}
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for n, piece in enumerate(pieces):
        new, fragments = stream.feed(piece, final=n == len(pieces) - 1)
        sent += new
        for f in fragments:
            if f.id is not None:
                assert f.index not in names and f.index == len(names)  # one header per call
                names[f.index] = f.name
            args[f.index] = args.get(f.index, "") + f.arguments
    assert sent.strip() == (content or "")
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == calls


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_plain_text_is_content_and_marker_prefixes_are_held_back(fmt):
    stream = ToolCallStream(fmt)
    shown, _ = stream.feed("The answer is 4. <tool")
    assert shown.startswith("The answer is 4.") or fmt is ToolFormat.LLAMA3_JSON
    rest, fragments = stream.feed("", final=True)
    assert shown + rest == "The answer is 4. <tool" and not fragments
    assert parse(fmt, "Hello there", final=True).calls == []


def test_templates_name_their_format():
    assert tool_format("{{ '<tool_call>' }}") is ToolFormat.HERMES
    assert tool_format("{%- if '[TOOL_CALLS]' %}") is ToolFormat.MISTRAL
    assert tool_format("<|python_tag|>{{ x }}") is ToolFormat.LLAMA3_JSON
    assert tool_format(None) is ToolFormat.HERMES


@pytest.mark.parametrize("fmt", list(ToolFormat))
@pytest.mark.parametrize("optional", [False, True])
def test_call_grammars_compile_and_match_the_parser(fmt, optional):
    from llguidance import LLMatcher

    functions = [{"name": "get_weather", "parameters": {"type": "object"}}]
    grammar = LLMatcher.grammar_from_lark(call_grammar(fmt, functions, True, optional))
    assert LLMatcher.validate_grammar(grammar) == ""


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_text_grammars_compile_and_are_the_call_grammars_text(fmt):
    # tool_choice "none" with the tools still shown: the text an optional call's grammar
    # allows, and nothing else.
    from llguidance import LLMatcher

    grammar = text_grammar(fmt)
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar)) == ""
    text_rule = grammar.splitlines()[1]
    assert text_rule in call_grammar(fmt, [{"name": "f"}], False, optional=True)
