"""The Go text/template subset used by Ollama `template` fields."""

import time

import pytest

from app.text.go_template import MAX_TEMPLATE_BYTES, TemplateError, render

CHATML = (
    "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
    "{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}"
    "<|im_start|>assistant\n"
)
LLAMA2 = "[INST] <<SYS>>{{ .System }}<</SYS>>\n\n{{ .Prompt }} [/INST]"


def test_chatml_with_and_without_system():
    assert render(CHATML, {"System": "Be brief.", "Prompt": "Hi"}) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(CHATML, {"System": "", "Prompt": "Hi"}) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama2_and_missing_known_fields_are_empty():
    assert render(LLAMA2, {"System": "S", "Prompt": "P"}) == "[INST] <<SYS>>S<</SYS>>\n\nP [/INST]"
    assert render(LLAMA2, {"Prompt": "P"}) == "[INST] <<SYS>><</SYS>>\n\nP [/INST]"
    assert render("{{ .Prompt }}{{ .Response }}", {"Prompt": "P"}) == "P"


def test_spacing_inside_actions_is_free():
    values = {"System": "S"}
    assert render("{{.System}}|{{  .System\t}}|{{\n.System\n}}", values) == "S|S|S"
    assert render("{{if.System}}y{{end}}", values) == "y"  # Go lexes `if.System` too


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("a  \n {{- .Prompt }}  b", "aP  b"),
        ("a  {{ .Prompt -}} \n\t b", "a  Pb"),
        ("a \n{{- .Prompt -}}\n b", "aPb"),
        ("x {{- /* note */ -}} y", "xy"),
        ("x {{/* note */}} y", "x  y"),
        ("{{ if .Prompt -}}\n  yes\n{{- end }}", "yes"),
        ("{{ if .System -}}\n  yes\n{{- else -}}\n  no\n{{- end }}", "no"),
        ("a {{- /* a\nmulti-line }} comment */}} b", "a b"),
        # `{{-3}}` is not a trim marker in Go (a dash must be followed by a space).
        ("x {{-.Prompt}}", None),
    ],
)
def test_trim_markers_and_comments(template, expected):
    if expected is None:
        with pytest.raises(TemplateError):
            render(template, {"Prompt": "P"})
    else:
        assert render(template, {"Prompt": "P"}) == expected


def test_trim_markers_never_touch_values():
    assert render("[{{- .Prompt -}}]", {"Prompt": "  P \n"}) == "[  P \n]"


@pytest.mark.parametrize(
    ("system", "prompt", "expected"),
    [("S", "P", "sys"), ("", "P", "prompt"), ("", "", "none"), ("S", "", "sys")],
)
def test_if_else_if_else(system, prompt, expected):
    template = "{{ if .System }}sys{{ else if .Prompt }}prompt{{ else }}none{{ end }}"
    assert render(template, {"System": system, "Prompt": prompt}) == expected


def test_nesting():
    template = (
        "{{ if .System }}<{{ if .Prompt }}both{{ else }}system only{{ end }}>"
        "{{ else }}{{ if .Prompt }}prompt only{{ end }}{{ end }}."
    )
    cases = {("S", "P"): "<both>.", ("S", ""): "<system only>.", ("", "P"): "prompt only."}
    for (system, prompt), expected in cases.items():
        assert render(template, {"System": system, "Prompt": prompt}) == expected
    assert render(template, {}) == "."


def test_deep_nesting_does_not_recurse():
    depth = 2500  # 62.5 KB, under the size cap
    template = "{{ if .Prompt }}" * depth + "x" + "{{ end }}" * depth
    assert render(template, {"Prompt": "P"}) == "x"
    assert render(template, {}) == ""


def test_extra_values_are_fields_too():
    assert render("{{ .Suffix }}", {"Suffix": "s"}) == "s"


@pytest.mark.parametrize(
    "value",
    ["C:\\Users\\x", "\\1 \\g<0> $1", "{{ .System }}", "{{ if", "}}{{", "{{/*", "-}}"],
)
def test_values_are_inserted_literally(value):
    template = "{{ if .Prompt }}[{{ .Prompt }}]{{ end }}"
    assert render(template, {"Prompt": value, "System": "S"}) == f"[{value}]"
    assert render(LLAMA2, {"System": value, "Prompt": value}).count(value) == 2


def test_braces_outside_actions_are_text():
    assert render("a }} b } { c", {}) == "a }} b } { c"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ range .Messages }}x{{ end }}", "{{ range }} is not supported"),
        ("{{ with .System }}x{{ end }}", "{{ with }} is not supported"),
        ('{{ template "x" }}', "{{ template }} is not supported"),
        ('{{ define "x" }}y{{ end }}', "{{ define }} is not supported"),
        ("{{ len .Prompt }}", "function calls (len) are not supported"),
        ("{{ .Prompt | html }}", "pipeline"),
        ("{{ $x := .Prompt }}", "variable"),
        ('{{ "lit" }}', "string literal"),
        ("{{ 3 }}", "number"),
        ("{{ (.Prompt) }}", "parenthesized"),
        ("{{ .Prompt .System }}", "after .Prompt"),
        ("{{ . }}", "whole data"),
        ("{{ .Messages.Content }}", "nested field"),
        ("{{ .Messages }}", "unknown field .Messages"),
        ("{{ if .Nope }}x{{ end }}", "unknown field .Nope"),
        ("{{ if not .System }}x{{ end }}", "only {{ if .Field }}"),
        ("{{ if }}x{{ end }}", "only {{ if .Field }}"),
        ("{{ else with .System }}", "only {{ if .Field }}"),
        ("{{ }}", "empty action"),
        ("ab\ncd {{ .Prompt ", "line 2, column 4: unterminated action"),
        ("{{ if .Prompt }}x", "line 1, column 1: {{ if }} is never closed"),
        ("x{{ end }}", "line 1, column 2: {{ end }} without"),
        ("{{ else }}", "{{ else }} without"),
        (
            "{{ if .Prompt }}a{{ else }}b{{ else }}c{{ end }}",
            "column 29: {{ else }} after {{ else }}",
        ),
        ("{{ if .Prompt }}a{{ else }}b{{ else if .System }}c{{ end }}", "after {{ else }}"),
        ("{{/* never closed }}", "unclosed comment"),
        ("{{/* x */ }}", "comment ends before the closing }}"),
        ("{{ /* x */ }}", "'/'"),
    ],
)
def test_unsupported_or_malformed_templates_raise(template, message):
    with pytest.raises(TemplateError) as e:
        render(template, {"Prompt": "P", "System": "S"})
    assert isinstance(e.value, ValueError)
    assert message in str(e.value)


def test_errors_in_branches_not_taken_still_raise():
    with pytest.raises(TemplateError, match="range"):
        render("{{ if .System }}{{ range .X }}{{ end }}{{ end }}", {})


def test_size_cap():
    at_cap = "x" * MAX_TEMPLATE_BYTES
    assert render(at_cap, {}) == at_cap
    with pytest.raises(TemplateError, match="65536 bytes"):
        render(at_cap + "x", {})
    with pytest.raises(TemplateError, match="65536 bytes"):  # bytes, not characters
        render("é" * (MAX_TEMPLATE_BYTES // 2 + 1), {})


@pytest.mark.parametrize(
    ("name", "template"),
    [
        ("32 KB of {{if", "{{if" * 8192),
        ("32 KB of {{if .Prompt}}", "{{if .Prompt}}" * 2340),
        ("32 KB of {{- if", "{{- if " * 4681),
        ("32 KB of {{/*", "{{/*" * 8192),
        ("60 KB of {{ .Prompt }}", "{{ .Prompt }}" * 4600),
        ("2 MB of text", "plain text " * 190_000),
    ],
)
def test_adversarial_templates_are_fast(name, template):
    started = time.perf_counter()
    try:
        render(template, {"Prompt": "P" * 1000})
        outcome = "rendered"
    except TemplateError as e:
        outcome = f"refused: {e}"[:80]
    elapsed = time.perf_counter() - started
    print(f"{name}: {elapsed * 1000:.1f} ms, {outcome}")
    assert elapsed < 5.0


def test_repeated_fields_cannot_blow_a_small_request_up():
    template = "{{ .Prompt }}" * 5000  # 65 KB of template
    with pytest.raises(TemplateError, match="passes 1000000 characters"):
        render(template, {"Prompt": "x" * 100_000}, max_chars=1_000_000)
    assert len(render(template, {"Prompt": "xy"}, max_chars=1_000_000)) == 10_000
