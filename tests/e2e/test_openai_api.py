"""The cluster as its users meet it: the official `openai` client against real processes.

One module-scoped cluster on loopback: the planner service, two workers on the paged
micro model (CPU), and two gateways sharing sessions through the real Redis. The test
that kills a worker runs last, since it leaves one worker.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import openai
import pytest
import redis

from tests.e2e.cluster import REDIS_URL, launch_gateway, start_gateway, start_planner, start_worker, stop_all
from tests.e2e.cluster import wait_gateway, wait_worker
from tests.e2e.cluster import free_port, worker_stats
from pagedweight.gateway.hashring import HashRing

MODEL = "micro"
PROMPT = "In the beginning"


@pytest.fixture(scope="module")
def cluster(paged_micro_dir, tmp_path_factory, redis_prefix):
    logs = tmp_path_factory.mktemp("e2e_logs")
    services = []
    try:
        planner, planner_address = start_planner(logs)
        services.append(planner)
        workers = [start_worker(f"worker{i}", paged_micro_dir, logs, planner=planner_address) for i in (1, 2)]
        services += [w for w, _ in workers]
        for service, address in workers:
            wait_worker(service, address)
        addresses = [a for _, a in workers]
        gateway_a, url_a = launch_gateway("gateway_a", paged_micro_dir, addresses, logs, redis_prefix)
        gateway_b, url_b = launch_gateway("gateway_b", paged_micro_dir, addresses, logs, redis_prefix)
        services += [gateway_a, gateway_b]
        wait_gateway(gateway_a, url_a)
        wait_gateway(gateway_b, url_b)
        yield {"workers": workers, "url_a": url_a, "url_b": url_b, "gateways": (gateway_a, gateway_b),
               "prefix": redis_prefix, "model_dir": paged_micro_dir, "logs": logs, "addresses": addresses}
    finally:
        stop_all(list(reversed(services)))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


# ---- completions and chat -----------------------------------------------------------------
def test_completion_plain_and_streamed_agree(cluster):
    api = client(cluster["url_a"])
    done = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    assert done.id.startswith("cmpl-") and done.object == "text_completion"
    assert done.usage.completion_tokens == 10 and done.usage.prompt_tokens > 0
    assert done.choices[0].finish_reason == "length" and done.choices[0].text
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == done.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len({c.id for c in chunks}) == 1


def test_chat_plain_and_streamed_agree(cluster):
    api = client(cluster["url_b"])
    messages = [{"role": "user", "content": "Say something."}]
    done = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert done.id.startswith("chatcmpl-") and done.object == "chat.completion"
    assert done.choices[0].message.role == "assistant"
    stream = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                         stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == done.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason


def test_sse_wire_format_is_vllms(cluster):
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{cluster['url_a']}/v1/completions", json=body, timeout=60)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("\n\n")
    events = r.text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    usage_chunk = json.loads(events[-2][len("data: "):])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_request_id_is_used_and_echoed(cluster):
    r = httpx.post(f"{cluster['url_a']}/v1/completions", headers={"X-Request-Id": "abc123"},
                   json={"prompt": PROMPT, "max_tokens": 2, "unknown_field": {"x": 1}}, timeout=60)
    assert r.status_code == 200, r.text  # unknown fields are accepted
    assert r.headers["x-request-id"] == "abc123" and r.json()["id"] == "cmpl-abc123"
    generated = httpx.get(f"{cluster['url_a']}/v1/models", timeout=10)
    assert generated.headers["x-request-id"]
    assert generated.json()["data"][0] | {"created": 0} == {
        "id": MODEL, "object": "model", "created": 0, "owned_by": "pagedweight", "root": MODEL, "parent": None,
        "max_model_len": 2048}


# ---- sampling -----------------------------------------------------------------------------
def test_seeded_choices_are_reproducible_across_gateways_and_streaming(cluster):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, n=3)
    first = client(cluster["url_a"]).completions.create(**kwargs)
    again = client(cluster["url_b"]).completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # n samples, not one sample three times
    streamed = ["", "", ""]
    for chunk in client(cluster["url_a"]).completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    other_seed = client(cluster["url_a"]).completions.create(**(kwargs | {"seed": 8}))
    assert [c.text for c in sorted(other_seed.choices, key=lambda c: c.index)] != texts


def test_stop_string_cuts_the_text_plain_and_streamed(cluster):
    api = client(cluster["url_a"])
    full = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 4, full
    stop = words[len(words) // 2]
    expected = full[: full.find(stop)]
    done = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert done.choices[0].text == expected
    assert done.choices[0].finish_reason == "stop"
    assert done.choices[0].model_extra["stop_reason"] == stop
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_several_prompts_times_n_choices_in_order(cluster):
    api = client(cluster["url_a"])
    single = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    ids = httpx.post(f"{cluster['url_a']}/tokenize", json={"prompt": "Second one"}, timeout=10).json()["tokens"]
    done = api.completions.create(model=MODEL, prompt=[PROMPT, "Second one"], max_tokens=6, temperature=0, n=2)
    by_index = {c.index: c.text for c in done.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[0] == by_index[1] == single  # greedy: prompt 0's two choices
    as_ids = api.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0).choices[0].text
    assert by_index[2] == by_index[3] == as_ids  # the same prompt given as token ids


def test_stop_token_ids_end_the_choice_and_min_tokens_holds_them_off(cluster):
    api, url = client(cluster["url_a"]), cluster["url_a"]
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    pieces = [c.choices[0].text for c in api.completions.create(**kwargs, stream=True)]

    def ids_of(text):
        return httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=10).json()["tokens"]

    # a later piece that is exactly one token and not seen before: the stop token
    seen, stop_at, stop_id = set(), None, None
    for k, piece in enumerate(pieces):
        ids = ids_of(piece) if piece else []
        if k >= 2 and len(ids) == 1 and ids[0] not in seen:
            stop_at, stop_id = k, ids[0]
            break
        seen.update(ids)
    assert stop_id is not None, pieces
    done = api.completions.create(**kwargs, extra_body={"stop_token_ids": [stop_id]})
    choice = done.choices[0]
    assert choice.text == "".join(pieces[:stop_at]) and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop_id
    held = api.completions.create(**kwargs, extra_body={"stop_token_ids": [stop_id], "min_tokens": stop_at + 1})
    assert held.usage.completion_tokens > stop_at  # the stop token could not end it that early
    # greedy up to the stop token's place, then something else: the stop token was masked there
    assert held.choices[0].text.startswith("".join(pieces[:stop_at]))
    assert not held.choices[0].text.startswith("".join(pieces[: stop_at + 1]))


def test_echo_prepends_the_prompt(cluster):
    done = client(cluster["url_a"]).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                                       echo=True)
    assert done.choices[0].text.startswith(PROMPT) and len(done.choices[0].text) > len(PROMPT)


# ---- sessions -----------------------------------------------------------------------------
def test_session_continues_on_another_gateway(cluster):
    session = f"s-{uuid.uuid4().hex[:8]}"
    first_turn = [{"role": "user", "content": "Tell me a story."}]
    reply = client(cluster["url_a"]).chat.completions.create(
        model=MODEL, messages=first_turn, max_tokens=6, temperature=0,
        extra_headers={"X-Session-ID": session}).choices[0].message.content
    second_turn = [{"role": "user", "content": "And then?"}]
    answer = client(cluster["url_b"]).chat.completions.create(  # only the new message, body session_id
        model=MODEL, messages=second_turn, max_tokens=6, temperature=0, extra_body={"session_id": session})
    whole = first_turn + [{"role": "assistant", "content": reply}] + second_turn
    expected = httpx.post(f"{cluster['url_a']}/tokenize", json={"messages": whole}, timeout=10).json()["count"]
    assert answer.usage.prompt_tokens == expected  # the gateway sent the whole conversation
    stored = redis.Redis.from_url(REDIS_URL)
    key = f"{cluster['prefix']}session:{session}"
    record = json.loads(stored.get(key))
    assert 0 < stored.pttl(key) <= 3600 * 1000
    stored.close()
    assert record["messages"] == whole + [{"role": "assistant", "content": answer.choices[0].message.content}]
    assert record["worker"] in cluster["addresses"]


# ---- what the openai client (guidellm, inference-perf) asks for -------------------------------
def test_models_retrieve_and_system_fingerprint(cluster):
    api = client(cluster["url_a"])
    card = api.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4o")
    done = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    chunks = list(api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, stream=True))
    assert done.system_fingerprint and done.system_fingerprint.startswith("fp_")
    assert {c.system_fingerprint for c in chunks} == {done.system_fingerprint}


def test_completion_logprobs_plain_and_streamed(cluster):
    api = client(cluster["url_a"])
    done = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4  # the top 3 and the sampled token
        assert top[token] == logprob and max(top.values()) == logprob  # greedy took the best
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                         stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs_with_top_logprobs(cluster):
    api = client(cluster["url_b"])
    done = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say something."}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = done.choices[0].logprobs.content
    assert len(content) == 5 and "".join(c.token for c in content) == done.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob
        assert bytes(entry.bytes).decode() == entry.token
    plain = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say something."}],
                                        max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_logit_bias_and_penalties_change_the_greedy_text(cluster):
    api = client(cluster["url_a"])
    token = httpx.post(f"{cluster['url_a']}/tokenize", json={"prompt": " the"}, timeout=10).json()["tokens"][-1]
    forced = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logit_bias={str(token): 100})
    assert forced.usage.completion_tokens == 4
    assert httpx.post(f"{cluster['url_a']}/tokenize", json={"prompt": forced.choices[0].text},
                      timeout=10).json()["tokens"] == [token] * 4
    plain = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    penalised = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                       frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.choices[0].text != plain.choices[0].text


# ---- deploy/e2e_client.py ---------------------------------------------------------------------
def test_the_deploy_smoke_client_passes_against_the_cluster_and_has_help(cluster):
    import subprocess
    import sys

    from tests.e2e.cluster import REPO

    script = REPO / "deploy" / "e2e_client.py"
    shown = subprocess.run([sys.executable, "-I", str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and "--url" in shown.stdout and "Exit status" in shown.stdout
    # -I: an isolated interpreter (no site-packages, no PYTHONPATH): the standard library is enough
    ran = subprocess.run([sys.executable, "-I", str(script), "--url", cluster["url_a"], "--model", MODEL],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "all checks passed" in ran.stdout and "FAIL" not in ran.stdout
    dead = subprocess.run([sys.executable, "-I", str(script), "--url", f"http://127.0.0.1:{free_port()}"],
                          capture_output=True, text=True, timeout=60)
    assert dead.returncode == 1 and "FAIL" in dead.stdout


# ---- bad requests -------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', 400, "body"),  # malformed JSON
    ("/v1/completions", b'', 400, "body"),  # an empty body
    ("/v1/completions", b'[1, 2]', 400, "body"),  # JSON, but no object
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": [999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "min_p": 0.1}, 400, "min_p"),  # the workers have no min-p cut
])
def test_bad_request_gets_4xx_json_and_the_server_keeps_serving(cluster, path, body, status, param):
    url = cluster["url_a"] + path
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"] and error["type"].endswith("Error")
    assert error["param"].split(".")[0] == param
    assert client(cluster["url_a"]).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices


def test_ten_megabyte_body_gets_413_json(cluster):
    body = json.dumps({"prompt": "a" * (10 << 20), "max_tokens": 1})
    r = httpx.post(f"{cluster['url_a']}/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert r.json()["error"]["type"] == "RequestTooLargeError"
    assert httpx.get(f"{cluster['url_a']}/health", timeout=10).status_code == 200


def test_api_key_guards_v1_only(cluster):
    gateway, url = start_gateway("gateway_key", cluster["model_dir"], cluster["addresses"], cluster["logs"],
                                 cluster["prefix"], extra=("--api-key", "sesame"))
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        gateway.stop()


def test_gateway_metrics_use_vllm_names(cluster):
    text = httpx.get(f"{cluster['url_a']}/metrics", timeout=10).text
    for name in ("vllm:e2e_request_latency_seconds_bucket", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:request_success_total", "vllm:generation_tokens_total", "vllm:prompt_tokens_total"):
        assert name in text, name
    served = [line for line in text.splitlines()
              if line.startswith("vllm:request_success_total") and 'finished_reason="length"' in line]
    assert float(served[0].rsplit(" ", 1)[1]) >= 1
    assert 'pagedweight:session_store{backend="redis"} 1.0' in text


def wait_idle(addresses, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(worker_stats(a).load.num_running + worker_stats(a).load.num_waiting == 0 for a in addresses):
            return True
        time.sleep(0.1)
    return False


def test_client_gone_mid_stream_aborts_its_worker_request(cluster):
    body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster['url_a']}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert sum(w.load.num_running for w in map(worker_stats, cluster["addresses"])) == 1
    assert wait_idle(cluster["addresses"])  # long before 1500 tokens could have been made


def test_requests_without_session_go_to_the_least_loaded_worker(cluster):
    body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster['url_a']}/v1/completions", json=body, timeout=60) as first:
        first_lines = first.iter_lines()  # kept: a dropped iterator closes the response
        assert next(first_lines).startswith("data: ")
        time.sleep(0.6)  # gateway b polls the workers' load (every 0.5 s) before it routes
        with httpx.stream("POST", f"{cluster['url_b']}/v1/completions", json=body, timeout=60) as second:
            second_lines = second.iter_lines()
            assert next(second_lines).startswith("data: ")
            assert [worker_stats(a).load.num_running for a in cluster["addresses"]] == [1, 1]
    assert wait_idle(cluster["addresses"])


def test_no_ready_worker_is_a_503_for_the_load_balancer(cluster):
    gateway, url = start_gateway("gateway_nowhere", cluster["model_dir"], [f"127.0.0.1:{free_port()}"],
                                 cluster["logs"], cluster["prefix"], wait=False)
    try:
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == 503
        with pytest.raises(openai.APIStatusError) as refused:
            client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == 503 and "no worker" in refused.value.body["message"]
    finally:
        gateway.stop()


# ---- failure: last, it leaves one worker ---------------------------------------------------
def test_worker_killed_mid_stream_ends_with_error_and_the_gateway_keeps_serving(cluster):
    # a gateway that polls rarely: it still thinks the killed worker is ready, so its first
    # request there fails before any byte and must be retried on the other worker
    slow, slow_url = start_gateway("gateway_slow_poll", cluster["model_dir"], cluster["addresses"],
                                   cluster["logs"], cluster["prefix"], extra=("--stats-interval", "600"))
    api = client(cluster["url_a"])
    stream = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, temperature=0,
                                    stream=True, extra_body={"ignore_eos": True})
    received = []
    with pytest.raises(openai.APIError) as failure:
        for chunk in stream:
            received.append(chunk)
            if len(received) == 3:
                busy = [(s, a) for s, a in cluster["workers"] if worker_stats(a).load.num_running > 0]
                assert len(busy) == 1
                busy[0][0].kill()
    assert len(received) >= 3 and "worker" in str(failure.value)
    for _ in range(4):  # the gateway routes around the dead worker
        assert api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).choices[0].text is not None
    health = httpx.get(f"{cluster['url_a']}/health", timeout=10)
    assert health.status_code == 200
    try:
        dead = next(a for s, a in cluster["workers"] if s.process.poll() is not None)
        ring = HashRing(cluster["addresses"])
        session = next(f"k{i}" for i in range(1000) if ring.get(f"k{i}") == dead)
        done = client(slow_url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                                   extra_headers={"X-Session-ID": session})
        assert done.choices[0].finish_reason in ("stop", "length")
        metrics = httpx.get(f"{slow_url}/metrics", timeout=10).text
        assert "pagedweight:gateway_retries_total 1.0" in metrics
    finally:
        slow.stop()


def test_the_gateways_metrics_carry_each_workers_engine_gauges(cluster):
    """A router or dashboard pointed at the API port finds the workers' load and memory."""
    from prometheus_client.parser import text_string_to_metric_families

    live = [a for s, a in cluster["workers"] if s.process.poll() is None]
    gone = set(cluster["addresses"]) - set(live)  # killed by an earlier test

    def scrape():
        text = httpx.get(f"{cluster['url_a']}/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stale(samples):
        return [a for a in gone if any(labels and ("engine", a) in labels for _, labels in samples)]

    # a killed worker's series go once a stats poll finds it not answering (a poll's connect can
    # take seconds on a loaded machine): none may remain after that
    deadline = time.monotonic() + 20
    samples = scrape()
    while stale(samples) and time.monotonic() < deadline:
        time.sleep(0.5)
        samples = scrape()
    assert not stale(samples)

    def value(name, address, **extra):
        return samples[(name, tuple(sorted({"model_name": MODEL, "engine": address, **extra}.items())))]

    for address in live:
        stats = worker_stats(address)
        assert value("pagedweight:budget_bytes", address) == stats.memory.budget_bytes > 0
        assert value("pagedweight:gpu_memory_bytes", address, component="dense_weights", bits="") == \
            stats.memory.dense_weight_bytes > 0
        assert 0.0 <= value("vllm:kv_cache_usage_perc", address) <= 1.0
        assert value("vllm:num_requests_waiting", address) >= 0
        assert value("vllm:num_requests_running", address) >= 0
        assert value("pagedweight:planner_connected", address) == 1.0
        assert value("pagedweight:mean_expert_bits", address) == pytest.approx(stats.bits.mean_expert_bits, abs=1.0)
    assert ("vllm:num_requests_running", (("engine", "gateway"), ("model_name", MODEL))) in samples
