"""Who may call the server, and how much one call may ask for.

Tenants: `--auth-token-file` holds one token (its tenant is `default`); `--tenants-file`
holds one `TENANT TOKEN [WEIGHT]` per line (`#` starts a comment), several tokens may share a
tenant (its weight is the largest given, 1 by default). A caller is known by
`authorization: Bearer <token>`; a tenant sees, reads and cancels only the jobs it submitted.
Without either file the server is open and every caller is the anonymous tenant "" (which
sees every job).

Shares: the request queue, the live-job and pending-item limits and the job store's bytes
are split between the tenants in proportion to their weights (`Tenants.share`), so one
tenant filling its share is refused while every other tenant still has room in its own.

Limits: every size is checked before any work is done for it (tokenizing, queueing,
writing), and a request over one is answered RESOURCE_EXHAUSTED (gRPC) or 413 / 429 (HTTP).
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import re
import socket
from pathlib import Path

from polyspec.workers.core.errors import ConfigError

DEFAULT_TENANT = "default"
TENANT_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
MAX_ID_CHARS = 256  # request ids (echoed in every stream message) and item ids
MAX_JOB_ID_CHARS = 64  # job ids are made by the server: "job-" + 16 hex digits
MAX_IDEMPOTENCY_KEY_CHARS = 128


@dataclasses.dataclass(frozen=True)
class Limits:
    max_prompt_bytes: int = 1 << 20  # one prompt's UTF-8 bytes, checked before tokenizing
    max_job_items: int = 100_000  # requests in one job
    max_live_jobs: int = 1_000  # queued or running jobs, all tenants together (each tenant: its share)
    max_pending_items: int = 1_000_000  # job items not run yet, all jobs together (each tenant: its share)
    max_store_bytes: int = 4 << 30  # the job store's requests, errors and results, all tenants (each: its share)
    job_retention_s: float = 7 * 86_400.0  # a finished, failed or cancelled job is deleted this long after it ended
    max_message_bytes: int = 4 << 20  # one gRPC message (gRPC's own default); a job's requests arrive in one
    max_prompts: int = 64  # prompts in one HTTP /v1/completions list
    max_body_bytes: int = 8 << 20  # one HTTP request body
    max_connections: int = 256  # open HTTP connections; more get 503
    max_rpcs: int = 1024  # gRPC calls in progress (streams included); more get RESOURCE_EXHAUSTED
    request_timeout_s: float = 30.0  # an HTTP client has this long to send its headers and body

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) <= 0:
                raise ConfigError(f"--{field.name.replace('_', '-')} must be > 0, got {getattr(self, field.name)}")


class Tenants:
    """token -> tenant; `tenant_of(authorization header)` -> tenant, or None when it is not allowed."""

    def __init__(self, tokens: dict[str, str], weights: dict[str, float] | None = None) -> None:
        self._tokens = [(f"Bearer {token}".encode(), tenant) for token, tenant in tokens.items()]
        self.weights = {tenant: (weights or {}).get(tenant, 1.0) for tenant in tokens.values()}

    def share(self, tenant: str | None, total: int) -> int:
        """`tenant`'s part of a limit of `total`, by weight (at least 1); all of it without tenants."""
        if not self.weights or tenant not in self.weights:
            return total
        return max(1, int(total * self.weights[tenant] / sum(self.weights.values())))

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def tenant_of(self, authorization) -> str | None:
        if not self._tokens:
            return ""
        given = authorization.encode() if isinstance(authorization, str) else (authorization or b"")
        found = None
        for expected, tenant in self._tokens:  # every token compared, in constant time each
            if hmac.compare_digest(given, expected):
                found = tenant
        return found

    @staticmethod
    def denial(authorization) -> str:
        return "missing authorization token" if not authorization else "wrong authorization token"

    @classmethod
    def from_files(cls, token_file: str | None, tenants_file: str | None) -> "Tenants":
        tokens: dict[str, str] = {}
        weights: dict[str, float] = {}
        if token_file:
            token = _read(token_file, "auth token file").strip()
            if not token:
                raise ConfigError(f"auth token file {token_file} is empty")
            tokens[token] = DEFAULT_TENANT
        if tenants_file:
            text = _read(tenants_file, "tenants file")
            for number, line in enumerate(text.splitlines(), start=1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                parts = line.split()
                if len(parts) not in (2, 3) or not TENANT_NAME.fullmatch(parts[0]):
                    raise ConfigError(f"{tenants_file} line {number}: expected 'TENANT TOKEN' or 'TENANT TOKEN WEIGHT' "
                                      "(tenant: letters, digits, _ . @ -)")
                tenant, token = parts[:2]
                if len(parts) == 3:
                    weights[tenant] = max(weights.get(tenant, 0.0), _weight(parts[2], f"{tenants_file} line {number}"))
                if len(token) < 16:
                    raise ConfigError(f"{tenants_file} line {number}: the token is shorter than 16 characters")
                if tokens.get(token, tenant) != tenant:
                    raise ConfigError(f"{tenants_file} line {number}: this token already belongs to tenant {tokens[token]!r}")
                tokens[token] = tenant
            if not tokens:
                raise ConfigError(f"tenants file {tenants_file} holds no tenant")
        return cls(tokens, weights)


def _weight(text: str, where: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        weight = 0.0
    if not 0 < weight <= 1000:
        raise ConfigError(f"{where}: the weight must be a number above 0 and at most 1000, got {text!r}")
    return weight


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what} {path}: {getattr(exc, 'strerror', None) or exc}") from None


def is_loopback(host: str) -> bool:
    """Does `host` name only this machine (127.0.0.0/8, ::1, localhost)?"""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    try:
        return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
    except ValueError:
        return False


def short(text: str, limit: int = 64) -> str:
    """`text` cut for an error message (a client-chosen string must not make the reply huge)."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
