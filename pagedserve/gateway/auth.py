"""API keys: each key belongs to a tenant, and the tenant is the prefix-cache salt, so the
KV blocks of one tenant's prompts are never served to another."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from pagedserve.common.errors import InvalidParameterError


def parse_api_keys(file: str | None, env_value: str | None) -> dict[str, str]:
    """key → tenant, from a file of lines "KEY [TENANT]" and from "KEY[:TENANT],..." (env).

    A key without a tenant is a tenant of its own (named by the key's hash, never the key).
    Authentication never fails open: a keys file without a key, or an empty key, is an
    error (the server refuses to start), not a server without authentication.
    """
    pairs: list[tuple[str, str | None]] = []
    if file:
        for line in Path(file).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                key, _, tenant = line.partition(" ")
                pairs.append((key, tenant.strip() or None))
        if not pairs:
            raise InvalidParameterError("api_keys_file", f"{file} holds no API key; refusing to start without authentication")
    for item in (env_value or "").split(","):
        item = item.strip()
        if item:
            key, _, tenant = item.partition(":")
            if not key.strip():
                raise InvalidParameterError("api_keys", "PAGEDSERVE_API_KEYS holds an empty key")
            pairs.append((key.strip(), tenant or None))
    return {key: tenant or "key-" + hashlib.sha256(key.encode()).hexdigest()[:16] for key, tenant in pairs}


def tenant_for(keys: dict[str, str], authorization: str | None) -> str | None:
    """The tenant of a `Bearer KEY` header; None when it names no known key."""
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    given = authorization[7:].strip().encode()
    for key, tenant in keys.items():
        if hmac.compare_digest(key.encode(), given):
            return tenant
    return None
