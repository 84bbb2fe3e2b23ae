"""Who is calling `/v1/*`: API keys, the tenant each belongs to, and its rate limit.

Keys are kept only as SHA-256 digests (`--api-keys-file`, one `tenant:sha256hex` a line,
typically mounted from a Kubernetes Secret), so a leaked file or process dump does not
give working keys. A request's key is hashed and looked up; the tenant's name then binds
the sessions it creates (sessions.py) and draws from the tenant's token bucket: at most
`rate` requests a second on average, `burst` at once, 429 with Retry-After past that.
The buckets are per gateway replica: N replicas admit up to N times the rate.

Without any key configured every caller is the anonymous tenant "" (sessions are then
protected only by their id).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

from pagedweight.common.errors import UserError

ANONYMOUS = ""
_LINE = re.compile(r"([A-Za-z0-9._-]{1,64}):([0-9a-f]{64})")


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def read_key_file(path: str | Path) -> dict[str, str]:
    """digest -> tenant from a file of `tenant:sha256hex` lines ('#' comments)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"--api-keys-file {path}: cannot read it ({err})") from None
    digests: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            raise UserError(f"--api-keys-file {path}:{number}: expected 'tenant:<sha256 hex of the key>' "
                            f"(tenant: letters, digits, '.', '_', '-')")
        digests[match.group(2)] = match.group(1)
    if not digests:
        raise UserError(f"--api-keys-file {path}: no keys in it")
    return digests


@dataclass(frozen=True)
class Verdict:
    status: int = 0  # 0: admitted; else the HTTP status to answer
    message: str = ""
    tenant: str = ANONYMOUS
    retry_after_s: int = 0


class _Bucket:
    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, time.monotonic()

    def take(self) -> float:
        """0 when a request may go now, else the seconds until one may."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class Tenants:
    def __init__(self, digests: dict[str, str] | None = None, rate_per_s: float | None = None,
                 burst: int | None = None):
        self.digests = dict(digests or {})  # sha256 hex of a key -> tenant
        self.rate_per_s = rate_per_s
        self.burst = burst if burst is not None else max(1, math.ceil(rate_per_s or 1))
        self._buckets: dict[str, _Bucket] = {}  # tenant -> its bucket

    @classmethod
    def from_settings(cls, api_key: str | None, keys_file: str | Path | None, rate_per_s: float | None,
                      burst: int | None) -> "Tenants":
        digests = read_key_file(keys_file) if keys_file else {}
        if api_key:
            digests[key_digest(api_key)] = "default"
        return cls(digests, rate_per_s, burst)

    @property
    def keys_required(self) -> bool:
        return bool(self.digests)

    def admit(self, authorization: str) -> Verdict:
        tenant = ANONYMOUS
        if self.digests:
            tenant = self._tenant(authorization)
            if tenant is None:
                return Verdict(401, "invalid or missing API key (Authorization: Bearer <key>)")
        if self.rate_per_s is not None:
            bucket = self._buckets.get(tenant)
            if bucket is None:
                if len(self._buckets) > 100_000:  # only configured tenants exist; a guard all the same
                    self._buckets.clear()
                bucket = self._buckets[tenant] = _Bucket(self.rate_per_s, self.burst)
            wait = bucket.take()
            if wait:
                return Verdict(429, f"rate limit reached ({self.rate_per_s:g} requests/s, burst {self.burst}); "
                                    f"retry later", tenant, max(1, math.ceil(wait)))
        return Verdict(tenant=tenant)

    def _tenant(self, authorization: str) -> str | None:
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        # headers arrive decoded as latin-1: its bytes are the bytes the client sent
        digest = hashlib.sha256(key.strip().encode("latin-1")).hexdigest()
        for known, tenant in self.digests.items():  # constant time per entry: no timing oracle
            if hmac.compare_digest(known, digest):
                return tenant
        return None
