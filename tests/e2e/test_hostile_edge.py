"""The gateway's edge against hostile clients, on a real worker, gateway and Redis.

Each case is one the gateway used to answer with a traceback, a hang, a coercion or a
cluster-wide outage: it must now answer one clear 4xx JSON error (or serve correctly),
promptly, and keep serving everyone else.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
import uuid

import httpx
import pytest
import redis

from tests.e2e.cluster import (
    REDIS_URL, start_gateway, start_worker, stop_all, wait_worker, worker_stats,
)

MODEL = "micro"
BODY = {"model": MODEL, "prompt": "In the beginning", "max_tokens": 2}
NESTED_LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
                "{% endfor %}{% endfor %}{% endfor %}")
OUTPUT_BOMB = "{% for a in range(100000) %}{{ messages[0]['content'] * 1000 }}{% endfor %}"
# a 1.5 GB constant in a branch "mul" takes, a 1.5 GB padding in a branch "pad" takes
HUGE_BRANCHES = ("{% set c = messages[0]['content'] %}{% if c == 'mul' %}{{ 'x' * 1500000000 }}"
                 "{% elif c == 'pad' %}{{ 'x' | center(1500000000) }}{% endif %}{{ c }}")


def model_copy(src, dst, template: str):
    """The gateway's view of a model (tokenizer and config) with another chat template."""
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    settings = json.loads((dst / "tokenizer_config.json").read_text())
    settings["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(settings))
    return dst


@pytest.fixture(scope="module")
def edge(paged_micro_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("edge_logs")
    prefix = f"pw-edge-{uuid.uuid4().hex[:8]}:"
    services = []
    try:
        worker, address = start_worker("worker", paged_micro_dir, logs)
        services.append(worker)
        wait_worker(worker, address)
        limits = ("--header-timeout", "1", "--body-timeout", "1", "--max-prompt-chars", "20000",
                  "--template-timeout", "2", "--max-header-bytes", "8192")
        gateway, url = start_gateway("gateway", paged_micro_dir, [address], logs, prefix, extra=limits)
        loops_dir = model_copy(paged_micro_dir, tmp_path_factory.mktemp("m") / "loops", NESTED_LOOPS)
        loops, loops_url = start_gateway("gateway_loops", loops_dir, [address], logs, prefix, extra=limits)
        bomb_dir = model_copy(paged_micro_dir, tmp_path_factory.mktemp("m") / "bomb", OUTPUT_BOMB)
        bomb, bomb_url = start_gateway("gateway_bomb", bomb_dir, [address], logs, prefix, extra=limits)
        huge_dir = model_copy(paged_micro_dir, tmp_path_factory.mktemp("m") / "huge", HUGE_BRANCHES)
        huge, huge_url = start_gateway("gateway_huge", huge_dir, [address], logs, prefix, extra=limits)
        services[:0] = [gateway, loops, bomb, huge]
        yield {"url": url, "loops_url": loops_url, "bomb_url": bomb_url, "huge_url": huge_url, "worker": address,
               "prefix": prefix, "gateway": gateway}
    finally:
        stop_all(services)
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:400])
    error = response.json()["error"]
    assert error["code"] == status and error["message"], error
    return error


def serves(url: str) -> None:
    response = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "10"), ("max_tokens", 2.0), ("stream", 1), ("stream", "true"), ("temperature", "0.5"),
    ("max_tokens", 2 ** 64), ("seed", 2 ** 70), ("top_k", -(2 ** 63)), ("min_tokens", 2 ** 40),
    ("stop_token_ids", [2 ** 40]), ("n", True),
])
def test_wrong_types_and_huge_integers_are_400_naming_the_field(edge, field, value):
    error = error_of(httpx.post(f"{edge['url']}/v1/completions", json={**BODY, field: value}, timeout=30), 400)
    assert error["param"].split(".")[0] == field, error


@pytest.mark.parametrize("raw", [
    b'{"model": "micro", "prompt": "\\ud800", "max_tokens": 2}',
    b'{"model": "micro", "prompt": "a", "max_tokens": 2, "user": "\\udfff"}',
    b'{"model": "micro", "prompt": "a", "max_tokens": 2, "\\ud800": 1}',
    b'{"model": "micro", "messages": [{"role": "user", "content": "x\\ud83d"}], "max_tokens": 2}',
    b'{"model": "micro", "prompt": [[1, 2], [3, 99999999999999999999999]], "max_tokens": 2}',
    b'{"model": "micro", "prompt": "a", "max_tokens": 2, "temperature": NaN}',
])
def test_lone_surrogates_nan_and_overflow_are_400(edge, raw):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    response = httpx.post(f"{edge['url']}{path}", content=raw, headers={"content-type": "application/json"},
                          timeout=30)
    error_of(response, 400)
    serves(edge["url"])


def test_a_bad_request_id_is_400_and_never_takes_the_worker_out(edge):
    for bad in ("caf\u00e9".encode("utf-8"), b"a\x01b", b"x" * 300):
        response = httpx.post(f"{edge['url']}/v1/completions", json=BODY, headers={"X-Request-Id": bad}, timeout=30)
        error_of(response, 400)
    ok = [httpx.post(f"{edge['url']}/v1/completions", json=BODY, timeout=30).status_code for _ in range(10)]
    assert ok == [200] * 10
    response = httpx.post(f"{edge['url']}/v1/completions", json=BODY, headers={"X-Request-Id": "ok-id.1"}, timeout=30)
    assert response.status_code == 200 and response.headers["x-request-id"] == "ok-id.1"


def test_bad_session_ids_are_400(edge):
    response = httpx.post(f"{edge['url']}/v1/completions", json=BODY, headers={"X-Session-ID": "a b"}, timeout=30)
    error_of(response, 400)
    response = httpx.post(f"{edge['url']}/v1/completions", json={**BODY, "session_id": "s" * 300}, timeout=30)
    assert error_of(response, 400)["param"] == "session_id"


def test_oversized_headers_are_431(edge):
    response = httpx.post(f"{edge['url']}/v1/completions", json=BODY, headers={"X-Junk": "j" * 9000}, timeout=30)
    error_of(response, 431)
    serves(edge["url"])


def test_a_long_prompt_is_413(edge):
    error_of(httpx.post(f"{edge['url']}/v1/completions", json={**BODY, "prompt": "a" * 20001}, timeout=30), 413)
    error_of(httpx.post(f"{edge['url']}/v1/completions", json={**BODY, "prompt": ["a" * 15000] * 2}, timeout=30), 413)
    error_of(httpx.post(f"{edge['url']}/tokenize", json={"prompt": "a" * 20001}, timeout=30), 413)


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def test_headers_sent_slowly_are_cut_off(edge):
    started = time.monotonic()
    with socket.create_connection(_host_port(edge["url"]), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        answer = b""
        try:
            for _ in range(8):  # one header byte every 0.5 s: each would reset an idle timer
                sock.sendall(b"X")
                time.sleep(0.5)
            answer = sock.recv(4096)
        except (ConnectionResetError, BrokenPipeError):
            pass
    assert time.monotonic() - started < 6
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:100]
    serves(edge["url"])


def test_a_body_sent_slowly_is_408(edge):
    with socket.create_connection(_host_port(edge["url"]), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n{\"model\":")
        answer = b""
        while b"}}" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code": 408' in answer or b'"code":408' in answer


def test_a_template_that_never_ends_is_400_and_does_not_block_others(edge):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(timeout=60) as client:
        started = time.monotonic()
        hung = [None]

        import threading

        def slow():
            hung[0] = client.post(f"{edge['loops_url']}/v1/chat/completions", json=chat)

        thread = threading.Thread(target=slow)
        thread.start()
        time.sleep(0.3)
        # the same gateway answers other requests while the template runs
        quick = client.post(f"{edge['loops_url']}/v1/completions", json=BODY)
        assert quick.status_code == 200 and time.monotonic() - started < 2
        thread.join(30)
    assert "within 2 s" in error_of(hung[0], 400)["message"]
    assert time.monotonic() - started < 10
    serves(edge["loops_url"])
    # the killed sandbox process was replaced: the next template job runs (and times out) again
    assert client_post_chat(edge["loops_url"], chat).status_code == 400


def client_post_chat(url, chat):
    return httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)


def test_a_template_that_multiplies_its_input_is_413(edge):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 100}], "max_tokens": 2}
    error_of(client_post_chat(edge["bomb_url"], chat), 413)
    serves(edge["bomb_url"])


def test_a_client_that_disconnects_stops_its_non_streaming_request(edge):
    body = {**BODY, "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{edge['url']}/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 5
    while worker_stats(edge["worker"]).load.num_running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker_stats(edge["worker"]).load.num_running == 0


def test_a_session_value_that_is_not_json_starts_the_session_afresh(edge):
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for junk in (b"\xff\xfe not json", b"[1, 2]", b'{"messages": "x"}', b'{"messages": [{"role": 1}]}'):
            client.set(f"{edge['prefix']}session:junk", junk)
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            response = httpx.post(f"{edge['url']}/v1/chat/completions", json=chat,
                                  headers={"X-Session-ID": "junk"}, timeout=30)
            assert response.status_code == 200, response.text
            stored = json.loads(client.get(f"{edge['prefix']}session:junk"))
            assert stored["messages"][0] == {"role": "user", "content": "hi"}
    finally:
        client.close()
    assert "Traceback" not in edge["gateway"].log_path.read_text()


def test_a_template_that_builds_a_huge_string_fails_alone_and_at_once(edge):
    def chat(content):
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        return client_post_chat(edge["huge_url"], body)

    started = time.monotonic()
    assert chat("hi").status_code == 200  # the branches not taken cost nothing
    assert "refused by the sandbox" in error_of(chat("mul"), 400)["message"]
    assert "out of memory" in error_of(chat("pad"), 400)["message"]
    assert chat("hi").status_code == 200
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("key", ["\u00b3", "\u2460", "\u0661", "\uff11"])
def test_logit_bias_keys_that_are_unicode_digits_are_400(edge, key):
    response = httpx.post(f"{edge['url']}/v1/completions", json={**BODY, "logit_bias": {key: 1.0}}, timeout=30)
    assert error_of(response, 400)["param"] == "logit_bias"


@pytest.mark.parametrize("field, value", [("top_p", 5e-324), ("top_p", 1e-40), ("repetition_penalty", 5e-324)])
def test_sampling_floats_that_float32_rounds_to_zero_are_400_naming_the_field(edge, field, value):
    response = httpx.post(f"{edge['url']}/v1/completions", json={**BODY, field: value}, timeout=30)
    assert error_of(response, 400)["param"] == field


def test_detokenize_is_bounded_by_the_context_and_decodes_off_the_event_loop(edge, paged_micro_dir):
    from pagedweight.frontend.tokenizer import Tokenizer

    started = time.monotonic()
    huge = httpx.post(f"{edge['url']}/detokenize", json={"tokens": [1] * 1_000_000}, timeout=30)
    assert "context length" in error_of(huge, 413)["message"]
    assert time.monotonic() - started < 5
    ids = list(range(3, 2048 + 3))  # the whole context: still served, and decoded as the tokenizer does
    response = httpx.post(f"{edge['url']}/detokenize", json={"tokens": ids}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["prompt"] == Tokenizer(paged_micro_dir).decode(ids)


def test_successful_probes_are_not_access_logged_but_requests_are(edge):
    for _ in range(3):
        assert httpx.get(f"{edge['url']}/health", timeout=10).status_code == 200
        assert httpx.get(f"{edge['url']}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{edge['url']}/v1/models?probe=1", timeout=10).status_code == 200
    deadline = time.monotonic() + 5
    while "GET /v1/models?probe=1" not in edge["gateway"].log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    log_text = edge["gateway"].log_path.read_text()
    assert "GET /v1/models?probe=1" in log_text
    assert "GET /health" not in log_text and "GET /metrics" not in log_text
