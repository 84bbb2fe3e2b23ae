"""Container HEALTHCHECK for the PagedWeight images; exit 0 when the service is ready.

    python healthcheck.py http http://127.0.0.1:8000/health
    python healthcheck.py grpc 127.0.0.1:50051 [SERVICE]

`http` expects a 200; `grpc` asks the standard grpc.health.v1 service (SERVICE defaults to
"readiness", the name the worker and planner report readiness under) for SERVING. The
image runs it as a file, not through the package, so a broken install still reports
unhealthy instead of failing to start the check.
"""

from __future__ import annotations

import sys
import urllib.request

TIMEOUT_S = 3.0


def check_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return response.status == 200
    except OSError:
        return False


def check_grpc(address: str, service: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "http":
        return 0 if check_http(argv[1]) else 1
    if len(argv) >= 2 and argv[0] == "grpc":
        return 0 if check_grpc(argv[1], argv[2] if len(argv) > 2 else "readiness") else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
