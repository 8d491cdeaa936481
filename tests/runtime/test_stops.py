"""StopMatcher over streamed text, checked against a plain whole-text reference."""

from __future__ import annotations

import random

import pytest

from edgellm.runtime.stops import StopMatcher


def stream(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    """Feed pieces until a stop; returns everything emitted (flush included when no stop) and whether one hit."""
    out = []
    for piece in pieces:
        text, hit = matcher.feed(piece)
        out.append(text)
        if hit:
            return out, True
    out.append(matcher.flush())
    return out, False


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Cut at the earliest occurrence of any stop string in the whole text."""
    found = [i for s in stops if s and (i := text.find(s)) >= 0]
    return (text[: min(found)], True) if found else (text, False)


def test_stop_split_across_many_feeds() -> None:
    m = StopMatcher(["<|end|>"])
    assert m.feed("Hello <") == ("Hello ", False)
    assert m.feed("|en") == ("", False)
    assert m.feed("d|") == ("", False)
    assert not m.hit
    assert m.feed(">tail") == ("", True)
    assert m.hit and m.matched == "<|end|>"
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_false_start_is_released_and_flush_returns_held_text() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("a ST") == ("a ", False)
    assert m.feed("OR") == ("STOR", False)
    assert m.feed("y S") == ("y ", False)
    assert m.flush() == "S"
    assert not m.hit and m.matched is None


def test_stop_at_the_very_start() -> None:
    m = StopMatcher(["\n\n"])
    assert m.feed("\n\nanything") == ("", True)
    m = StopMatcher(["ab"])
    assert m.feed("a") == ("", False)
    assert m.feed("b") == ("", True)


def test_multiple_stops_earliest_wins() -> None:
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", True)
    assert m.matched == "lo w"
    m = StopMatcher(["xyz", "b"])
    assert m.feed("axy") == ("a", False)  # "xy" may start "xyz"
    assert m.feed("b") == ("xy", True)


def test_overlapping_prefixes() -> None:
    # In "aaab" the false start "aa" turns into "a" + the real "aab": only the first "a" may be emitted.
    m = StopMatcher(["aab"])
    out, hit = stream(m, ["a", "a", "a", "b", "c"])
    assert ("".join(out), hit) == ("a", True)
    m = StopMatcher(["abab", "bac"])
    out, hit = stream(m, list("ababac"))
    assert ("".join(out), hit) == ("", True) and m.matched == "abab"
    m = StopMatcher(["abcd", "bce"])
    out, hit = stream(m, list("abce"))
    assert ("".join(out), hit) == ("a", True) and m.matched == "bce"


def test_a_single_string_is_one_stop() -> None:
    assert StopMatcher("END").feed("bEND") == ("b", True)
    assert StopMatcher("END").feed("bE") == ("b", False)


def test_no_stops_and_empty_stops_pass_everything() -> None:
    m = StopMatcher(["", ""])
    assert m.feed("text") == ("text", False)
    assert m.flush() == ""


@pytest.mark.parametrize("seed", range(200))
def test_random_streams_match_whole_text_reference(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab<|>\n"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 10))))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    out, hit = stream(StopMatcher(stops), pieces)
    assert ("".join(out), hit) == reference(text, stops)
    # Nothing emitted before the end can be the start of a stop that only completes later.
    emitted = ""
    m = StopMatcher(stops)
    for piece in pieces:
        text_now, hit = m.feed(piece)
        emitted += text_now
        if hit:
            break
        assert reference(text, stops)[0].startswith(emitted)
