#!/usr/bin/env python3
"""Smoke-test a running PagedWeight gateway (Compose, Helm, `make run`) as a client would.

    python deploy/e2e_client.py --url http://127.0.0.1:8000 [--model NAME] [--api-key KEY]

Checks, one line each: /health answers, /v1/models lists the model and /v1/models/{id}
finds it, a completion returns its tokens, a streamed completion ends with usage and
[DONE], a chat continues its session (X-Session-Status: new, then continued), /metrics
has vLLM's families. Exits 0 when every check passes, 1 otherwise. Standard library only,
so it runs wherever Python 3.10+ does (a pod, a CI job) with nothing installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
import uuid


class Gateway:
    def __init__(self, url: str, api_key: str | None, timeout_s: float):
        self.url, self.api_key, self.timeout_s = url.rstrip("/"), api_key, timeout_s

    def request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None):
        """(status, headers, body bytes); HTTP errors are answers too."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        for key, value in (headers or {}).items():
            request.add_header(key, value)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, response.headers, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.headers, err.read()


def checks(gateway: Gateway, model: str | None):
    """Yields (name, ok, detail) per check."""
    status, _, body = gateway.request("GET", "/health")
    yield "health", status == 200, f"HTTP {status} {body[:200].decode(errors='replace')}"

    status, _, body = gateway.request("GET", "/v1/models")
    models = [m["id"] for m in json.loads(body).get("data", [])] if status == 200 else []
    model = model or (models[0] if models else None)
    yield "models", model in models, f"HTTP {status}, served {models}"
    if model is None:
        return
    status, _, body = gateway.request("GET", f"/v1/models/{model}")
    yield "model card", status == 200 and json.loads(body).get("id") == model, f"HTTP {status}"

    prompt = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
              "ignore_eos": True}
    status, _, body = gateway.request("POST", "/v1/completions", prompt)
    usage = json.loads(body).get("usage", {}) if status == 200 else {}
    yield "completion", usage.get("completion_tokens") == 8, f"HTTP {status}, usage {usage}"

    status, _, body = gateway.request("POST", "/v1/completions",
                                      {**prompt, "stream": True, "stream_options": {"include_usage": True}})
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    last_usage = json.loads(events[-2]).get("usage") if len(events) >= 2 else None
    ok = status == 200 and events[-1:] == ["[DONE]"] and (last_usage or {}).get("completion_tokens") == 8
    yield "streamed completion", ok, f"HTTP {status}, {len(events)} events, usage {last_usage}"

    session = f"e2e-client-{uuid.uuid4().hex[:8]}"
    said = []
    for content in ("Hello!", "And then?"):
        status, headers, _ = gateway.request(
            "POST", "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4},
            {"X-Session-ID": session})
        said.append((status, headers.get("x-session-status")))
    yield "chat session", said == [(200, "new"), (200, "continued")], f"(status, X-Session-Status): {said}"

    status, _, body = gateway.request("GET", "/metrics")
    text = body.decode(errors="replace")
    wanted = ("vllm:time_to_first_token_seconds", "vllm:request_success_total", "vllm:generation_tokens_total")
    missing = [name for name in wanted if name not in text]
    yield "metrics", status == 200 and not missing, f"HTTP {status}, missing {missing}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Exit status: 0 when every check passes, 1 otherwise.")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (default %(default)s)")
    parser.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None, help="the gateway's API key, if it has one")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default %(default)s)")
    args = parser.parse_args(argv)
    gateway = Gateway(args.url, args.api_key, args.timeout)
    failed = 0
    try:
        for name, ok, detail in checks(gateway, args.model):
            print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
            failed += not ok
    except OSError as err:
        print(f"FAIL cannot reach {args.url}: {err}")
        return 1
    print("all checks passed" if not failed else f"{failed} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
