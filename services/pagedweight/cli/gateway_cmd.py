"""`pagedweight gateway`: the OpenAI-compatible REST front of the workers.

    pagedweight gateway --model DIR --workers HOST:PORT[,HOST:PORT...] [--port 8000]
        [--api-key KEY] [--redis-url URL] [--max-queued-requests N] [--session-ttl S]

Torch-free: this module imports the gateway only when run, and `python -m
pagedweight.cli.gateway_cmd` starts it without loading the rest of the command line (the
gateway's image has no torch).
"""

from __future__ import annotations

import argparse
import os
import sys

from pagedweight.cli.numbers import finite_floats_everywhere, port
from pagedweight.cli.rpc_args import add_rpc_security_arguments
from pagedweight.common.errors import UserError

HELP = "serve the OpenAI-compatible REST API in front of the workers"


def add_arguments(parser) -> None:
    from pagedweight.gateway.config import DEFAULT_REDIS_URL, GatewayConfig as C

    parser.add_argument("--model", required=True,
                        help="the served model's directory (for its tokenizer, chat template and context length)")
    parser.add_argument("--workers", required=True, help="worker gRPC addresses, comma-separated host:port")
    parser.add_argument("--host", default=C.host, help="address to listen on")
    parser.add_argument("--port", type=port, default=C.port, help="HTTP port")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the model directory's name)")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDWEIGHT_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDWEIGHT_API_KEY)")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
                        help="Redis for sessions (default: $REDIS_URL or %(default)s); "
                             "an in-process store when it does not answer")
    parser.add_argument("--session-key-prefix", default=C.session_key_prefix,
                        help="prefix of the Redis keys (gateways sharing sessions use the same)")
    parser.add_argument("--api-keys-file", default=None, metavar="FILE",
                        help="API keys by tenant, one 'tenant:<sha256 hex of the key>' a line "
                             "(e.g. from a Kubernetes Secret); sessions are bound to the tenant")
    parser.add_argument("--rate-limit", type=float, default=None, metavar="RPS",
                        help="requests a second per tenant (per gateway replica); more get 429")
    parser.add_argument("--rate-limit-burst", type=int, default=None, metavar="N",
                        help="requests a tenant may send at once (default: the rate, rounded up)")
    parser.add_argument("--session-ttl", type=float, default=C.session_ttl_s,
                        help="seconds a session lives after its last request")
    parser.add_argument("--max-queued-requests", type=int, default=C.max_queued_requests,
                        help="requests in flight at this gateway before new ones get 503")
    parser.add_argument("--max-body-bytes", type=int, default=C.max_body_bytes,
                        help="larger request bodies get 413")
    parser.add_argument("--max-header-bytes", type=int, default=C.max_header_bytes,
                        help="larger request headers (all together) get 431")
    parser.add_argument("--max-prompt-chars", type=int, default=C.max_prompt_chars,
                        help="longer prompts, messages or rendered chats get 413")
    parser.add_argument("--header-timeout", type=float, default=C.header_timeout_s,
                        help="seconds a connection may take to send a request's headers")
    parser.add_argument("--body-timeout", type=float, default=C.body_timeout_s,
                        help="seconds a request body may take to arrive (then 408)")
    parser.add_argument("--template-timeout", type=float, default=C.template_timeout_s,
                        help="seconds a chat template may render and a prompt tokenise (then 400)")
    parser.add_argument("--text-workers", type=int, default=C.text_workers,
                        help="processes that render chat templates and tokenise prompts")
    parser.add_argument("--worker-timeout", type=float, default=C.worker_timeout_s,
                        help="longest a single worker call may take")
    parser.add_argument("--stats-interval", type=float, default=C.stats_interval_s,
                        help="seconds between polls of the workers' readiness and load")
    add_rpc_security_arguments(parser, server=False)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds open streams get to finish (at least the workers' drain)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def register(subparsers) -> None:
    parser = subparsers.add_parser("gateway", help=HELP)
    add_arguments(parser)
    parser.set_defaults(handler=run_gateway)


def config_from_args(args):
    from pagedweight.gateway.config import GatewayConfig

    workers = tuple(a.strip() for a in args.workers.split(",") if a.strip())
    return GatewayConfig(
        model_dir=args.model, workers=workers, host=args.host, port=args.port,
        served_model_name=args.served_model_name, api_key=args.api_key or None, redis_url=args.redis_url,
        session_key_prefix=args.session_key_prefix, session_ttl_s=args.session_ttl,
        max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
        stats_interval_s=args.stats_interval, api_keys_file=args.api_keys_file, rate_limit_rps=args.rate_limit,
        rate_limit_burst=args.rate_limit_burst, max_header_bytes=args.max_header_bytes,
        max_prompt_chars=args.max_prompt_chars, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout, template_timeout_s=args.template_timeout, text_workers=args.text_workers,
        worker_timeout_s=args.worker_timeout, rpc_token_file=args.rpc_token_file, rpc_tls_ca=args.rpc_tls_ca,
        rpc_tls_cert=args.rpc_tls_cert, rpc_tls_key=args.rpc_tls_key,
    )


PROBE_PATHS = ("/health", "/metrics", "/version")  # polled every few seconds by probes and scrapers


def quiet_probes(record) -> bool:
    """uvicorn's access log without the successful polls of PROBE_PATHS, which would
    drown every request worth reading (a failed poll is still logged)."""
    args = record.args
    if isinstance(args, tuple) and len(args) == 5:  # (client, method, path, http version, status)
        path, status = str(args[2]).split("?", 1)[0], args[4]
        return not (path in PROBE_PATHS and isinstance(status, int) and status < 400)
    return True


def run_gateway(args) -> int:
    import logging

    if not os.path.isdir(args.model):
        raise UserError(f"--model {args.model}: no such directory")
    config = config_from_args(args)  # bad flags fail here, before the heavier imports
    if args.shutdown_timeout < 0:
        raise UserError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")

    import uvicorn

    from pagedweight.common.ports import bind_tcp
    from pagedweight.gateway.api_server import build_app
    from pagedweight.gateway.http_protocol import header_timeout_protocol

    # the port first: a taken one is one error line, before anything claims to serve
    sock = bind_tcp(config.host, config.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(config)
    print(f"pagedweight gateway: http://{config.host}:{config.port}/v1 (model {config.model_name!r}, "
          f"workers {','.join(config.workers)})", flush=True)
    # h11: the one HTTP parser whose request-line and header limit can be set; ours (431)
    # answers below it, its own (a 400) only catches what is far past ours
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.shutdown_timeout,
                                           http=header_timeout_protocol(config.header_timeout_s),
                                           h11_max_incomplete_event_size=4 * config.max_header_bytes))
    # after uvicorn.Config, which sets up uvicorn's loggers
    logging.getLogger("uvicorn.access").addFilter(quiet_probes)
    server.run(sockets=[sock])
    return 0


def main(argv=None) -> int:
    """`python -m pagedweight.cli.gateway_cmd ...`: this command alone, as `pagedweight gateway`."""
    parser = argparse.ArgumentParser(prog="pagedweight gateway", description=HELP)
    add_arguments(parser)
    finite_floats_everywhere(parser)
    args = parser.parse_args(argv)
    try:
        return run_gateway(args)
    except UserError as err:
        print(f"pagedweight gateway: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
