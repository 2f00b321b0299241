import pytest

from app.text.detokenizer import IncrementalDetokenizer
from app.text.stop import StopStrings


def run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    s = StopStrings(stops)
    out = "".join(s.feed(p) for p in pieces)
    if not s.stopped:
        out += s.flush()
    return out, s.stopped


@pytest.mark.parametrize(
    ("pieces", "expected", "stopped"),
    [
        (["Hello wor", "ld END more"], "Hello world ", True),
        (["Hello E", "N", "D tail"], "Hello ", True),
        (["abc", "EN"], "abcEN", False),  # a partial stop at the end is real text
        (["ENDx"], "", True),
        (["no stop here"], "no stop here", False),
    ],
)
def test_stop_strings_across_pieces(pieces, expected, stopped):
    assert run(["END"], pieces) == (expected, stopped)


def test_earliest_of_several_stops_wins():
    assert run(["\n\n", "Q:"], ["answer Q", ": next\n\nmore"]) == ("answer ", True)


def test_nothing_after_stop_is_emitted_piecewise():
    s = StopStrings(["###"])
    emitted = [s.feed(p) for p in ["a#", "#", "b", "##", "#c"]]
    assert "".join(emitted) == "a##b"
    assert s.stopped and s.feed("more") == ""


def test_detokenizer_never_emits_broken_utf8(smollm2_tokenizer):
    text = "Café ☕ naïve 😀 — 日本語のテキスト"
    ids = smollm2_tokenizer(text).input_ids
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_ids=[])
    pieces = [detok.add([t]) for t in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == smollm2_tokenizer.decode(ids)
