"""`pagedweight planner`: the planner service (bit plans for registered workers, torch-free).

    pagedweight planner --port 50052 [--http-port 9092] [--host 127.0.0.1]
"""

from __future__ import annotations

import asyncio
import logging

from pagedweight.common.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser("planner", help="run the planner service (gRPC)")
    parser.add_argument("--port", type=int, default=50052, help="gRPC port")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    parser.add_argument("--http-port", "--metrics-port", dest="http_port", type=int, default=None,
                        help="side HTTP port for /metrics, /health, /ready (default: none)")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from pagedweight.planner_service.server import serve

    for name in ("port", "http_port"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= 65535:
            raise UserError(f"--{name.replace('_', '-')} must be in 0..65535, got {value}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(args.port, args.http_port, args.host))
    return 0
