"""`pagedweight gateway`: the OpenAI-compatible REST front of the workers.

    pagedweight gateway --model DIR --workers HOST:PORT[,HOST:PORT...] [--port 8000]
        [--api-key KEY] [--redis-url URL] [--max-queued-requests N] [--session-ttl S]

Torch-free: this module imports the gateway only when run (`python -m pagedweight.gateway`
starts it without loading the rest of the command line).
"""

from __future__ import annotations

import os

from pagedweight.common.errors import UserError

HELP = "serve the OpenAI-compatible REST API in front of the workers"


def add_arguments(parser) -> None:
    from pagedweight.gateway.config import DEFAULT_REDIS_URL, GatewayConfig as C

    parser.add_argument("--model", required=True,
                        help="the served model's directory (for its tokenizer, chat template and context length)")
    parser.add_argument("--workers", required=True, help="worker gRPC addresses, comma-separated host:port")
    parser.add_argument("--host", default=C.host, help="address to listen on")
    parser.add_argument("--port", type=int, default=C.port, help="HTTP port")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the model directory's name)")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDWEIGHT_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDWEIGHT_API_KEY)")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
                        help="Redis for sessions (default: $REDIS_URL or %(default)s); "
                             "an in-process store when it does not answer")
    parser.add_argument("--session-key-prefix", default=C.session_key_prefix,
                        help="prefix of the Redis keys (gateways sharing sessions use the same)")
    parser.add_argument("--session-ttl", type=float, default=C.session_ttl_s,
                        help="seconds a session lives after its last request")
    parser.add_argument("--max-queued-requests", type=int, default=C.max_queued_requests,
                        help="requests in flight at this gateway before new ones get 503")
    parser.add_argument("--max-body-bytes", type=int, default=C.max_body_bytes,
                        help="larger request bodies get 413")
    parser.add_argument("--stats-interval", type=float, default=C.stats_interval_s,
                        help="seconds between polls of the workers' readiness and load")
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
        max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes, stats_interval_s=args.stats_interval,
    )


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

    # the port first: a taken one is one error line, before anything claims to serve
    sock = bind_tcp(config.host, config.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(config)
    print(f"pagedweight gateway: http://{config.host}:{config.port}/v1 (model {config.model_name!r}, "
          f"workers {','.join(config.workers)})", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    server.run(sockets=[sock])
    return 0
