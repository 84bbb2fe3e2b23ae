"""Stop strings and incremental detokenisation as a stream sees them."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pagedweight.gateway.text import StopStringFilter, TextCodec

ALPHABET = "ab\nX"


def full_cut(text: str, stops: tuple[str, ...]) -> str:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(hits)] if hits else text


@settings(max_examples=300, deadline=None)
@given(text=st.text(ALPHABET, max_size=40),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3).map(tuple),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_streamed_stop_filter_releases_exactly_the_cut_text(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    filt = StopStringFilter(stops)
    released = []
    for piece in pieces:
        released.append(filt.push(piece))
        if filt.hit is not None:
            break
    if filt.hit is None:
        released.append(filt.flush())
    out = "".join(released)
    assert out == full_cut(text, stops)
    # what was released never contains a stop string, even across chunk boundaries
    assert not any(s in out for s in stops)
    assert (filt.hit is not None) == (out != text or any(s in text for s in stops))


def test_stop_hit_names_the_earliest_stop():
    filt = StopStringFilter(("cd", "b"))
    assert filt.push("abcd") == "a"
    assert filt.hit == "b"
    assert filt.push("more") == ""


def test_incremental_detokenizer_matches_full_decode(bundled_model_dir):
    codec = TextCodec(bundled_model_dir)
    text = "Hello, wörld! 日本語のテキスト — naïve café ✓ end"
    ids = codec.encode(text)
    prompt = codec.encode("Prompt: ")
    detok = codec.detokenizer(prompt)
    streamed = "".join(detok.push([t]) for t in ids)
    assert streamed == codec.decode(ids)
    assert "\ufffd" not in streamed
