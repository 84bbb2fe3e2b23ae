"""Hostile request bodies against a real gateway and worker: a 4xx JSON error or a correct answer.

A valid completion or chat body is mutated field by field (wrong types, out-of-range and
huge numbers, nested junk, unknown keys) or replaced by bytes that are not JSON at all.
Every answer must be either 200 with a well-formed OpenAI response, or a 4xx whose body
is exactly vLLM's error shape with `code` equal to the status. Never a 5xx, never a hang,
and after every example the server still answers a plain request. Same modes as the rest
of the fuzz suite (PAGEDWEIGHT_FUZZ=long for 300 examples per test).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.e2e.cluster import start_gateway, start_planner, start_worker, stop_all, wait_worker
from tests.fuzz.harness import fuzz_settings
from tests.fuzz.strategies import EDGE_TEXT

MODEL = "micro"
# Values that are wrong somewhere: every field gets some of these.
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.lists(st.integers(min_value=-5, max_value=70000), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
# Numbers in range for the micro model, so that some mutated bodies are valid and run.
SMALL_TOKENS = st.integers(min_value=1, max_value=4)
FIELDS = {
    "max_tokens": st.one_of(SMALL_TOKENS, JUNK), "temperature": st.one_of(st.floats(0, 2), JUNK),
    "top_p": st.one_of(st.floats(0.01, 1), JUNK), "top_k": st.one_of(st.integers(-1, 50), JUNK),
    "n": st.one_of(st.integers(1, 2), JUNK), "seed": JUNK, "stop": st.one_of(st.text(max_size=3), JUNK),
    "stream": JUNK, "stop_token_ids": JUNK, "min_tokens": st.one_of(st.integers(0, 2), JUNK),
    "ignore_eos": JUNK, "echo": JUNK, "user": JUNK, "session_id": JUNK, "stream_options": JUNK,
    "model": st.one_of(st.just(MODEL), JUNK), "logprobs": JUNK, "unknown_field": JUNK,
}


def mutated(base: dict) -> st.SearchStrategy[dict]:
    return st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=4).flatmap(
        lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys}).map(lambda m: {**base, **m}))


COMPLETION = mutated({"model": MODEL, "prompt": "In the beginning", "max_tokens": 2}).flatmap(
    lambda body: st.one_of(st.just(body), JUNK.map(lambda p: {**body, "prompt": p})))
CHAT = mutated({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).flatmap(
    lambda body: st.one_of(st.just(body), JUNK.map(lambda m: {**body, "messages": m}),
                           JUNK.map(lambda c: {**body, "messages": [{"role": "user", "content": c}]})))
RAW = st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode),
                st.just(b'{"model": "micro", "prompt": "a", "max_tokens": 1'), st.just(b"\xff\xfe{}"),
                st.just(b"[" * 5000 + b"]" * 5000), st.just(b'{"max_tokens": 1e999}'))


@pytest.fixture(scope="module")
def gateway(paged_micro_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz_http_logs")
    services = []
    try:
        planner, planner_address = start_planner(logs)
        worker, worker_address = start_worker("worker", paged_micro_dir, logs, planner=planner_address)
        services += [planner, worker]
        wait_worker(worker, worker_address)
        gw, url = start_gateway("gateway", paged_micro_dir, [worker_address], logs, "pw-fuzz:")
        services.insert(0, gw)
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client
    finally:
        stop_all(services)


def check_answer(response: httpx.Response, body_was_stream: bool) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}, error
        assert error["code"] == response.status_code and error["message"], error
        return
    assert response.status_code == 200
    if body_was_stream:
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "data: [DONE]", response.text[-300:]
        for event in events[:-1]:
            json.loads(event[len("data: "):])  # each event is one JSON object (or an error event)
    else:
        answer = response.json()
        assert answer["choices"] and all("index" in c for c in answer["choices"]), answer
        assert answer["usage"]["completion_tokens"] >= 0


def still_serving(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
    assert response.status_code == 200, response.text


@fuzz_settings(ci_examples=25)
@given(body=COMPLETION)
def test_completion_bodies(gateway, body):
    check_answer(gateway.post("/v1/completions", json=body), body.get("stream") is True)
    still_serving(gateway)


@fuzz_settings(ci_examples=20)
@given(body=CHAT)
def test_chat_bodies(gateway, body):
    check_answer(gateway.post("/v1/chat/completions", json=body), body.get("stream") is True)
    still_serving(gateway)


@fuzz_settings(ci_examples=15)
@given(raw=RAW, path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]))
def test_raw_bytes(gateway, raw, path):
    response = gateway.post(path, content=raw, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert response.json()["error"]["code"] == response.status_code
    still_serving(gateway)


HEADER_TEXT = st.one_of(st.text(st.characters(min_codepoint=0x20, max_codepoint=0xff), max_size=40),
                        st.sampled_from(["caf\u00e9", "x" * 300, "a b", "\u00ff" * 5, "", " ", "ok-id"]))


@fuzz_settings(ci_examples=40)
@given(request_id=st.one_of(st.none(), HEADER_TEXT), session_id=st.one_of(st.none(), HEADER_TEXT),
       authorization=st.one_of(st.none(), HEADER_TEXT))
def test_header_values(gateway, request_id, session_id, authorization):
    """Any header value the HTTP layer lets through: 200 or a 4xx, and never a worker taken
    out of routing (the plain request after it is served)."""
    headers = {name: value.encode("latin-1") for name, value in (
        ("X-Request-Id", request_id), ("X-Session-ID", session_id), ("Authorization", authorization))
        if value is not None and "\r" not in value and "\n" not in value}
    try:
        response = gateway.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1},
                                headers=headers)
    except httpx.LocalProtocolError:  # the client itself refuses to send it
        return
    check_answer(response, False)
    still_serving(gateway)


@fuzz_settings(ci_examples=30)
@given(body=st.one_of(
    st.fixed_dictionaries({"prompt": JUNK}), st.fixed_dictionaries({"messages": JUNK}),
    st.fixed_dictionaries({"prompt": st.text(max_size=40), "add_special_tokens": JUNK}),
    st.fixed_dictionaries({"tokens": st.one_of(JUNK, st.lists(st.integers(-5, 2 ** 40), max_size=5))}),
    st.fixed_dictionaries({"tokens": st.lists(st.integers(0, 200), max_size=5), "model": JUNK})))
def test_tokenize_and_detokenize(gateway, body):
    path = "/detokenize" if "tokens" in body else "/tokenize"
    response = gateway.post(path, json=body)
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert response.json()["error"]["code"] == response.status_code
    else:
        answer = response.json()
        assert ("tokens" in answer and answer["count"] == len(answer["tokens"])) or isinstance(answer.get("prompt"), str)
    still_serving(gateway)


SAMPLING_FLOATS = st.sampled_from([5e-324, 1e-45, 1e-40, 2.0 ** -126, 1e-300, 0.0, -0.0, 0.5, 1.0, 1.0000001, 2.0])
SAMPLING = st.fixed_dictionaries({}, optional={
    "top_p": SAMPLING_FLOATS, "min_p": SAMPLING_FLOATS, "repetition_penalty": SAMPLING_FLOATS,
    "temperature": SAMPLING_FLOATS, "presence_penalty": SAMPLING_FLOATS,
    "logit_bias": st.dictionaries(st.sampled_from([t for t in EDGE_TEXT if t.isprintable() and "\udcff" not in t
                                                   and "\udcc3" not in t] + ["\u00b3", "\u2460", "\u0661", "007"]),
                                  SAMPLING_FLOATS, max_size=3),
})


@fuzz_settings(ci_examples=25)
@given(fields=SAMPLING)
def test_sampling_fields_at_their_edges_are_served_or_refused_by_name(gateway, fields):
    """Values a float32 rounds to zero and keys Python calls digits: a 400 names the field."""
    response = gateway.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1, **fields})
    check_answer(response, False)
    if response.status_code == 400:
        assert response.json()["error"]["param"].split(".")[0] in fields, response.text
    still_serving(gateway)
