"""Container HEALTHCHECK for the PagedWeight images: exit 0 when the service is ready.

    python healthcheck.py http://127.0.0.1:8000/health    # the gateway
    python healthcheck.py http://127.0.0.1:9100/ready     # a worker's or the planner's side port

Any answer but 200 (503 while a worker loads its model or drains), or none within the
timeout, is unhealthy. Standard library only, and run as a file rather than through the
package, so a broken install reports unhealthy instead of failing to start the check.
"""

from __future__ import annotations

import sys
import urllib.request

TIMEOUT_S = 3.0


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return response.status == 200
    except OSError:  # refused, timed out, or an HTTP error status
        return False


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].startswith("http://"):
        print(__doc__, file=sys.stderr)
        return 2
    return 0 if ready(argv[0]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
