"""The internal RPC security flags (common/rpc_security.py), the same on every service."""

from __future__ import annotations

import argparse


def add_rpc_security_arguments(parser: argparse.ArgumentParser, server: bool) -> None:
    """The internal RPC flags (common/rpc_security.py), the same on every service."""
    parser.add_argument("--rpc-token-file", default=None, metavar="FILE",
                        help="internal RPC token(s), one 'name:token' or token a line "
                             "(default: $PAGEDWEIGHT_RPC_TOKEN)")
    parser.add_argument("--rpc-tls-cert", default=None, metavar="PEM", help="this service's TLS certificate")
    parser.add_argument("--rpc-tls-key", default=None, metavar="PEM", help="its private key")
    parser.add_argument("--rpc-tls-ca", default=None, metavar="PEM",
                        help="CA of the peers' certificates (servers then require client certificates)")
    if server:
        parser.add_argument("--insecure-rpc", action="store_true",
                            help="allow an unauthenticated gRPC port on a non-loopback interface")
