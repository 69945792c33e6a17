"""API keys: each key belongs to a tenant. The tenant is the prefix-cache salt, so the KV
blocks of one tenant's prompts are never served to another, and the unit of fairness: each
tenant has its own queue stream and its own limits on what it may have in flight.

The keys file has one key per line, `KEY [TENANT] [max_requests=N] [max_queued_tokens=N]`;
the limits belong to the tenant (give them once per tenant) and default to the server's
`--tenant-max-requests` and `--tenant-max-queued-tokens`.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from pagedserve.common.errors import InvalidParameterError


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """What one tenant may hold in the queue at once; None: the server's default."""

    max_requests: int | None = None  # prompts admitted and not yet finished (queued or running)
    max_queued_tokens: int | None = None  # prompt tokens admitted and not yet taken by a worker


_LIMIT_NAMES = ("max_requests", "max_queued_tokens")


def _key_lines(file: str) -> list[tuple[str, str | None, TenantLimits]]:
    """(key, tenant, limits) of each line of a keys file; comments and blank lines skipped."""
    lines = []
    for number, line in enumerate(Path(file).read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        key, rest = words[0], words[1:]
        tenant = rest.pop(0) if rest and "=" not in rest[0] else None
        limits: dict[str, int] = {}
        for word in rest:
            name, _, value = word.partition("=")
            if name not in _LIMIT_NAMES or not value.isdigit() or int(value) < 1:
                raise InvalidParameterError("api_keys_file", f"{file}:{number}: {word!r} is not one of "
                                                             f"{', '.join(n + '=N' for n in _LIMIT_NAMES)} (N >= 1)")
            limits[name] = int(value)
        lines.append((key, tenant, TenantLimits(**limits)))
    if not lines:
        raise InvalidParameterError("api_keys_file", f"{file} holds no API key; refusing to start without authentication")
    return lines


def _key_tenant(key: str) -> str:
    """The tenant of a key given without one: named by the key's hash, never the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def parse_tenant_limits(file: str | None) -> dict[str, TenantLimits]:
    """tenant → the limits its keys file lines set (tenants without any are left out)."""
    found: dict[str, TenantLimits] = {}
    for key, tenant, limits in _key_lines(file) if file else []:
        if limits == TenantLimits():
            continue
        name = tenant or _key_tenant(key)
        if found.setdefault(name, limits) != limits:
            raise InvalidParameterError("api_keys_file", f"{file}: the tenant {name!r} is given two different limits")
    return found


def parse_api_keys(file: str | None, env_value: str | None) -> dict[str, str]:
    """key → tenant, from the keys file and from "KEY[:TENANT],..." (env).

    A key without a tenant is a tenant of its own (named by the key's hash, never the key).
    Authentication never fails open: a keys file without a key, or an empty key, is an
    error (the server refuses to start), not a server without authentication.
    """
    pairs: list[tuple[str, str | None]] = []
    if file:
        pairs += [(key, tenant) for key, tenant, _ in _key_lines(file)]
    for item in (env_value or "").split(","):
        item = item.strip()
        if item:
            key, _, tenant = item.partition(":")
            if not key.strip():
                raise InvalidParameterError("api_keys", "PAGEDSERVE_API_KEYS holds an empty key")
            pairs.append((key.strip(), tenant or None))
    return {key: tenant or _key_tenant(key) for key, tenant in pairs}


def tenant_for(keys: dict[str, str], authorization: str | None) -> str | None:
    """The tenant of a `Bearer KEY` header; None when it names no known key."""
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    given = authorization[7:].strip().encode()
    for key, tenant in keys.items():
        if hmac.compare_digest(key.encode(), given):
            return tenant
    return None
