"""StopStrings against a reference over the whole text; its limits and its cost."""

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.protocol.errors import InvalidRequestError
from app.text.stop import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    StopStrings,
    check_stop_strings,
)


def reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """The whole text at once: cut at the earliest-starting stop, shortest on ties."""
    hits = [(i, s) for s in stops if s and (i := text.find(s)) >= 0]
    if not hits:
        return text, None
    at, stop = min(hits)
    return text[:at], stop


def undecided_from(stops: list[str], fed: str) -> int:
    """The first position that a stop string may still start at (or starts at)."""
    stops = [s for s in stops if s]
    return (
        min(
            i
            for i in range(len(fed) + 1)
            if any(s.startswith(fed[i:]) or fed.startswith(s, i) for s in stops)
        )
        if stops
        else len(fed)
    )


def splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)] or [""]


ALPHABET = "abc"
texts = st.text(alphabet=ALPHABET, max_size=40)
stop_sets = st.lists(st.text(alphabet=ALPHABET, max_size=5), max_size=6)
cut_lists = st.lists(st.integers(min_value=0, max_value=40), max_size=12)


@settings(max_examples=1500, deadline=None)
@given(stops=stop_sets, text=texts, cuts=cut_lists)
def test_matches_reference_for_any_split(stops, text, cuts):
    expected, matched = reference(stops, text)
    s = StopStrings(stops)
    emitted, fed = "", ""
    for piece in splits(text, cuts):
        was_stopped = s.stopped
        emitted += s.feed(piece)
        fed += piece
        assert expected.startswith(emitted)  # nothing after a stop ever leaks
        if not was_stopped:  # held back exactly while undecided
            assert len(emitted) == (
                len(reference(stops, fed)[0]) if s.stopped else undecided_from(stops, fed)
            )
    emitted += s.flush()
    assert (emitted, s.stopped, s.matched) == (expected, matched is not None, matched)
    if s.stopped:
        assert s.feed("abc") == "" and s.flush() == ""


def test_longer_stop_starting_earlier_wins_across_deltas():
    # "c" completes first, but "abcd" starts earlier: wait for the "d" to decide.
    s = StopStrings(["abcd", "c"])
    assert s.feed("xabc") == "x"
    assert not s.stopped
    assert s.feed("d") == ""
    assert s.stopped and s.matched == "abcd"


def test_pending_stop_is_cut_when_the_longer_one_fails():
    s = StopStrings(["abcd", "c"])
    assert s.feed("xabc") == "x"
    assert s.feed("e tail") == "ab"
    assert s.matched == "c"


def test_pending_stop_is_cut_at_flush():
    s = StopStrings(["abcd", "c"])
    assert s.feed("xabc") == "x"
    assert s.flush() == "ab"
    assert s.stopped and s.matched == "c"


def test_tie_at_one_start_goes_to_the_shorter_stop():
    s = StopStrings(["END", "EN"])
    assert s.feed("xEND") == "x"
    assert s.matched == "EN"


def test_no_stops_passes_text_through():
    s = StopStrings(["", ""])
    assert s.feed("abc") == "abc" and s.flush() == "" and not s.stopped


def test_check_stop_strings_drops_empty_and_keeps_order():
    assert check_stop_strings(["b", "", "a"], "stop") == ["b", "a"]
    at_limit = ["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS
    assert check_stop_strings(at_limit + [""], "stop") == at_limit


def test_check_stop_strings_limits_the_count():
    with pytest.raises(InvalidRequestError) as e:
        check_stop_strings([str(i) for i in range(MAX_STOP_STRINGS + 1)], "options.stop")
    assert e.value.status_code == 400 and e.value.param == "options.stop"
    assert "at most 64" in e.value.message and "65" in e.value.message


def test_check_stop_strings_limits_the_length():
    with pytest.raises(InvalidRequestError) as e:
        check_stop_strings(["ok", "x" * (MAX_STOP_STRING_CHARS + 1)], "stop")
    assert e.value.param == "stop"
    assert "1025 characters" in e.value.message and "at most 1024" in e.value.message


@pytest.mark.parametrize("kind", ["adversarial", "random"])
def test_max_stops_over_100kb_in_1_char_deltas_is_fast(kind):
    rng = random.Random(0)
    if kind == "adversarial":  # every stop is live all the time: 1023 chars held back
        stops = ["a" * (MAX_STOP_STRING_CHARS - 1) + chr(0x100 + i) for i in range(64)]
        text = "a" * 100_000
    else:
        stops = ["".join(rng.choices("ab", k=MAX_STOP_STRING_CHARS)) for _ in range(64)]
        text = "".join(rng.choices("ab", k=100_000))
    assert check_stop_strings(stops, "stop") == stops
    started = time.perf_counter()
    s = StopStrings(stops)
    built = time.perf_counter()
    out = "".join(s.feed(ch) for ch in text) + s.flush()
    done = time.perf_counter()
    print(f"{kind}: build {built - started:.3f}s, 100 KB in 1-char deltas {done - built:.3f}s")
    assert out == reference(stops, text)[0]
    assert done - started < 5.0
