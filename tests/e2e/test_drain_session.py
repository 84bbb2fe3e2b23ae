"""A reply cut by a worker's drain: the client sees finish_reason "abort" and the session
stores the reply as aborted, not as a complete turn."""

from __future__ import annotations

import json
import signal

import openai
import redis

from tests.e2e.cluster import REDIS_URL, start_gateway, start_worker, stop_all, wait_worker


def test_a_drained_reply_ends_with_abort_and_is_stored_as_such(paged_micro_dir, tmp_path, redis_prefix):
    services = []
    try:
        worker, address = start_worker("worker", paged_micro_dir, tmp_path, extra=("--shutdown-timeout", "0.5"))
        services.append(worker)
        wait_worker(worker, address)
        prefix = f"{redis_prefix}drain:"
        gateway, url = start_gateway("gateway", paged_micro_dir, [address], tmp_path, prefix)
        services.insert(0, gateway)
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = api.chat.completions.create(
            model="micro", messages=[{"role": "user", "content": "Tell me everything."}], max_tokens=1500,
            temperature=0, stream=True, extra_body={"ignore_eos": True, "session_id": "drained"})
        text, reasons = "", []
        for i, chunk in enumerate(stream):
            if i == 3:
                worker.process.send_signal(signal.SIGTERM)  # drain: 0.5 s, then running requests abort
            for choice in chunk.choices:
                text += choice.delta.content or ""
                reasons.append(choice.finish_reason)
        assert reasons[-1] == "abort"
        stored = json.loads(redis.Redis.from_url(REDIS_URL).get(f"{prefix}session:drained"))
        reply = stored["messages"][-1]
        assert reply == {"role": "assistant", "content": text, "finish_reason": "abort"}
        assert worker.process.wait(30) == 0
    finally:
        stop_all(services)
