"""`pagedweight planner`: the planner service (bit plans for registered workers, torch-free).

    pagedweight planner --port 50052 [--http-port 9092] [--host 127.0.0.1]
        [--min-mean-bits 4.5] [--target-itl-ms 50]

The dial flags set the operator's dial at start (planner/dial.py); the SetDial RPC changes it
while the service runs (docs/planner.md).
"""

from __future__ import annotations

import asyncio
import logging

from pagedweight.cli.numbers import port, positive_seconds
from pagedweight.cli.rpc_args import add_rpc_security_arguments
from pagedweight.common.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser("planner", help="run the planner service (gRPC)")
    parser.add_argument("--port", type=port, default=50052, help="gRPC port")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    parser.add_argument("--http-port", "--metrics-port", dest="http_port", type=port, default=None,
                        help="side HTTP port for /metrics, /health, /ready (default: none)")
    parser.add_argument("--max-workers", type=int, default=64,
                        help="registrations kept at once, each caller of the token file holding at most "
                             "an even share; more get RESOURCE_EXHAUSTED")
    parser.add_argument("--registration-ttl", type=positive_seconds, default=900.0,
                        help="seconds without a call after which a worker's registration is dropped")
    parser.add_argument("--min-mean-bits", type=float, default=0.0,
                        help="quality floor: never free expert bytes below every block at this mean width "
                             "(3..8; default 0: none)")
    parser.add_argument("--target-itl-ms", type=float, default=0.0,
                        help="hold raises while a worker's inter-token latency is above this (default 0: none)")
    add_rpc_security_arguments(parser, server=True)
    parser.set_defaults(handler=run)


def run(args) -> int:
    from pagedweight.planner_service.server import serve

    for name in ("port", "http_port"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= 65535:
            raise UserError(f"--{name.replace('_', '-')} must be in 0..65535, got {value}")
    if not 1 <= args.max_workers <= 100_000:
        raise UserError(f"--max-workers must be in 1..100000, got {args.max_workers}")
    from pagedweight.common.rpc_security import RpcSecurity
    from pagedweight.planner.dial import OperatorDial

    try:
        dial = OperatorDial(args.min_mean_bits, args.target_itl_ms / 1000)
    except ValueError as err:
        raise UserError(f"--min-mean-bits / --target-itl-ms: {err}") from None

    security = RpcSecurity.from_settings(args.rpc_token_file, args.rpc_tls_ca, args.rpc_tls_cert, args.rpc_tls_key,
                                         args.insecure_rpc)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(args.port, args.http_port, args.host, security=security, max_workers=args.max_workers,
                      registration_ttl_s=args.registration_ttl, dial=dial))
    return 0
