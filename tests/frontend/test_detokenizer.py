"""Incremental detokenisation and stop strings against one full decode, property-based."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedweight.common.errors import UserError
from pagedweight.frontend.detokenizer import (
    IncrementalDetokenizer, RequestDetokenizer, find_stop, partial_stop_len,
)
from pagedweight.frontend.tokenizer import Tokenizer
from tests.conftest import BUNDLED_MODEL, shared_model_dirs


def _distinct_tokenizers():
    """The bundled and shared models' tokenizers, one per distinct tokenizer.json."""
    seen, out = set(), []
    for d in [BUNDLED_MODEL, *shared_model_dirs()]:
        digest = hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            out.append(Tokenizer(d))
    return out


TOKENIZERS = _distinct_tokenizers()
TEXTS = st.text(
    alphabet=st.one_of(st.characters(codec="utf-8"), st.sampled_from(list(" \n\té世界🎉ïß"))),
    max_size=60,
)


def chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    """Split ids at the given points (engine steps deliver 1 token; other callers more)."""
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(points, points[1:])]


def stream(detok, chunks):
    deltas = [detok.push(c) for c in chunks]
    return deltas


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_deltas_concatenate_to_the_full_decode(tokenizer, data):
    # Random ids hit byte tokens that split (or never complete) UTF-8 characters;
    # encoded text covers leading spaces and multi-byte characters as models emit them.
    if data.draw(st.booleans()):
        ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=40))
    else:
        ids = tokenizer.encode(data.draw(TEXTS))
    cuts = data.draw(st.lists(st.integers(0, 64), max_size=10))
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(c) for c in chunked(ids, cuts)]
    deltas.append(detok.finish())
    assert "".join(deltas) == tokenizer.decode(ids)


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_split_characters_are_held_until_complete(tokenizer):
    text = " héllo 世界 🎉 naïve"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # this tokenizer does split characters into bytes
    assert "".join(deltas) + detok.finish() == text


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_stop_strings_cut_the_text_at_the_earliest_match(tokenizer, data):
    ids = tokenizer.encode(data.draw(TEXTS.filter(lambda t: len(t) > 2)))
    full = tokenizer.decode(ids)
    # stop strings: pieces of the text (so they match, often across tokens) and strangers
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if data.draw(st.booleans()) and full:
            a = data.draw(st.integers(0, len(full) - 1))
            b = data.draw(st.integers(a + 1, min(len(full), a + 6)))
            stops.append(full[a:b])
        else:
            stops.append(data.draw(st.text(min_size=1, max_size=4)))
    include = data.draw(st.booleans())
    cuts = data.draw(st.lists(st.integers(0, 64), max_size=10))
    detok = RequestDetokenizer(tokenizer, [1, 2], stop=stops, include_stop_str_in_output=include)
    sent, stopped = "", False
    for chunk in chunked(ids, cuts):
        delta = detok.push(chunk)
        assert not stopped or delta.text == ""  # nothing after the stop
        sent += delta.text
        stopped = delta.stopped
        if stopped:
            break
    if not stopped:
        final = detok.finish()
        sent += final.text
        stopped = final.stopped

    # every occurrence of every stop string; the first to complete (then the longest) wins
    hits = [(i + len(s), -len(s), i, s) for s in stops for i in range(len(full)) if full.startswith(s, i)]
    if hits:
        _, _, index, stop = min(hits)
        assert stopped and detok.stop_reason == stop
        assert sent == (full[: index + len(stop)] if include else full[:index])
    else:
        assert not stopped and sent == full
    assert detok.text == sent


def test_text_that_may_begin_a_stop_string_is_held_back():
    tokenizer = TOKENIZERS[0]
    detok = RequestDetokenizer(tokenizer, stop=["END"])
    ids = tokenizer.encode("abc EN")
    out = "".join(detok.push([t]).text for t in ids)
    assert out == "abc " and detok.text == "abc "  # "EN" may become "END"
    assert detok.finish().text == "EN"  # the request ended without it: release


def test_stop_token_ids_path_ends_with_finish_and_loses_nothing():
    tokenizer = TOKENIZERS[0]
    detok = RequestDetokenizer(tokenizer, stop=["zzz"])
    ids = tokenizer.encode("In the beginning 世界")
    text = "".join(detok.push([t]).text for t in ids) + detok.finish().text
    assert text == "In the beginning 世界" and not detok.stopped


def test_find_stop_and_partial_stop_len():
    assert find_stop("abc END xyz STOP", ("STOP", "END")) == (4, "END")
    assert find_stop("nothing", ("STOP",)) is None
    assert find_stop("xxab", ("ab", "xab")) == (1, "xab")  # same end: the longer one
    assert find_stop("abcd", ("abcd", "bc")) == (1, "bc")  # "bc" completes first
    assert partial_stop_len("hello wo", ("world", "o")) == 2
    assert partial_stop_len("hello", ("world",)) == 0


@pytest.mark.parametrize("stop", [[""], [3]])
def test_bad_stop_strings_are_refused(stop):
    with pytest.raises(UserError):
        RequestDetokenizer(TOKENIZERS[0], stop=stop)
