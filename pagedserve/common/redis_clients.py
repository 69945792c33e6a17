"""The one place pagedserve makes its Redis clients, from a URL.

Two kinds of URL:

- `redis://`, `rediss://` (TLS), `unix://`: one Redis, through redis-py's `from_url`.
- `redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB][?sentinel_password=...]`:
  a primary that Redis Sentinel watches. The client asks the Sentinels (port 26379 unless
  given) where SERVICE's primary is before each new connection, and asks again after a
  connection fails or the old primary answers READONLY (it was demoted): after a failover
  every client reaches the promoted replica without a restart (redis-py's
  `SentinelConnectionPool`). Nothing here keeps an address of its own.

Passwords. The primary's: the URL's, else `$PAGEDSERVE_REDIS_PASSWORD` (for both kinds of
URL, so that the URL can sit in a ConfigMap and the password in a Secret). The Sentinels'
(their `requirepass`): `sentinel_password` in the URL's query, else
`$PAGEDSERVE_REDIS_SENTINEL_PASSWORD`, else none. Never argv: pass them in the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel

from pagedserve.common.errors import InvalidParameterError

#: the URL scheme of a primary found through Sentinel
SENTINEL_SCHEME = "redis+sentinel"
#: a Sentinel's port when the URL gives none
DEFAULT_SENTINEL_PORT = 26379
#: where the primary's password is read when the URL has none
PASSWORD_ENV = "PAGEDSERVE_REDIS_PASSWORD"
#: where the Sentinels' password is read when the URL's query has none
SENTINEL_PASSWORD_ENV = "PAGEDSERVE_REDIS_SENTINEL_PASSWORD"
#: the only query field a Sentinel URL takes
_SENTINEL_QUERY_FIELDS = ("sentinel_password",)


@dataclass(frozen=True)
class SentinelTarget:
    """What a `redis+sentinel://` URL names."""

    sentinels: tuple[tuple[str, int], ...]  # each Sentinel's host and port, in the URL's order
    service_name: str  # the name the Sentinels monitor the primary under (`sentinel monitor NAME ...`)
    db: int  # the database number on the primary
    username: str | None  # the primary's ACL user; None: `default`
    password: str | None  # the primary's password; None: it asks for none
    sentinel_password: str | None  # the Sentinels' own password (their requirepass); None: none


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() == SENTINEL_SCHEME


def _host_port(text: str) -> tuple[str, int]:
    """`host`, `host:port`, `[v6]` or `[v6]:port`."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise InvalidParameterError("redis_url", f"a Sentinel address {text!r} does not parse")
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise InvalidParameterError("redis_url", f"a Sentinel address {text!r} has no host")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidParameterError("redis_url", f"a Sentinel address {text!r} has no valid port")
    return host, int(port_text)


def parse_sentinel_url(url: str, environ: Mapping[str, str] | None = None) -> SentinelTarget:
    """The Sentinels, the service and the passwords a `redis+sentinel://` URL names (passwords
    it lacks from the environment). A malformed URL is an InvalidParameterError naming the
    problem, never the password."""
    environ = os.environ if environ is None else environ
    if not is_sentinel_url(url):
        raise InvalidParameterError("redis_url", f"a Sentinel URL starts with {SENTINEL_SCHEME}://")
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, password = None, None
    if userinfo:
        user_text, has_password, password_text = userinfo.partition(":")
        username = unquote(user_text) or None
        password = unquote(password_text) if has_password else None
    if not hosts:
        raise InvalidParameterError("redis_url", "a Sentinel URL names no Sentinel (HOST:PORT[,HOST:PORT...])")
    sentinels = tuple(_host_port(h) for h in hosts.split(","))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise InvalidParameterError("redis_url", "a Sentinel URL's path is /SERVICE or /SERVICE/DB")
    service_name = unquote(path[0])
    db_text = path[1] if len(path) == 2 else "0"
    if not db_text.isdigit():
        raise InvalidParameterError("redis_url", f"a Sentinel URL's database {db_text!r} is not a number")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(query) - set(_SENTINEL_QUERY_FIELDS))
    if unknown:
        raise InvalidParameterError("redis_url", f"a Sentinel URL takes only {', '.join(_SENTINEL_QUERY_FIELDS)} "
                                    f"in its query, not {', '.join(unknown)}")
    return SentinelTarget(
        sentinels=sentinels, service_name=service_name, db=int(db_text), username=username,
        password=password or environ.get(PASSWORD_ENV) or None,
        sentinel_password=query.get("sentinel_password") or environ.get(SENTINEL_PASSWORD_ENV) or None)


def _sentinel_kwargs(target: SentinelTarget, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """How the client talks to the Sentinels: the same socket timeouts as to the primary,
    and their own password."""
    sentinel_kwargs = {k: v for k, v in kwargs.items() if k in ("socket_timeout", "socket_connect_timeout")}
    if target.sentinel_password is not None:
        sentinel_kwargs["password"] = target.sentinel_password
    return sentinel_kwargs


def _primary_kwargs(target: SentinelTarget) -> dict[str, Any]:
    return {"db": target.db, "username": target.username, "password": target.password}


def _password_from_env(url: str, environ: Mapping[str, str] | None) -> dict[str, Any]:
    """`password=` for `from_url` when the URL has none and the environment has one."""
    environ = os.environ if environ is None else environ
    if environ.get(PASSWORD_ENV) and not urlsplit(url).password and "password=" not in urlsplit(url).query:
        return {"password": environ[PASSWORD_ENV]}
    return {}


class _SentinelRedis(redis.Redis):
    """A client of the primary that also closes its connections to the Sentinels."""

    def close(self) -> None:
        super().close()
        cast(Any, self.connection_pool).sentinel_manager.close()  # a SentinelConnectionPool's


class _AsyncSentinelRedis(aioredis.Redis):
    """The same, for asyncio."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        await cast(Any, self.connection_pool).sentinel_manager.aclose()


class _BlockingSentinelConnectionPool(aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's pool that, like the gateway's plain one, waits up to `timeout` for a free
    connection when all `max_connections` are taken instead of failing at once."""


def sync_client(url: str, environ: Mapping[str, str] | None = None, **kwargs: Any) -> redis.Redis:
    """A client for a worker, the prefix cache service or the KV tier; `kwargs` are
    redis-py's connection options (socket_timeout, health_check_interval...)."""
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **_password_from_env(url, environ), **kwargs)
    target = parse_sentinel_url(url, environ)
    sentinel = redis.sentinel.Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, kwargs))
    return sentinel.master_for(target.service_name, redis_class=_SentinelRedis, **_primary_kwargs(target), **kwargs)


def async_client(url: str, *, max_connections: int, timeout: float, environ: Mapping[str, str] | None = None,
                 **kwargs: Any) -> aioredis.Redis:
    """A client for the gateway: at most `max_connections` connections, a caller waits up to
    `timeout` seconds for a free one; `kwargs` are redis-py's connection options."""
    if not is_sentinel_url(url):
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout, **_password_from_env(url, environ), **kwargs)
        return aioredis.Redis(connection_pool=pool)
    target = parse_sentinel_url(url, environ)
    sentinel = aiosentinel.Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, kwargs))
    return sentinel.master_for(target.service_name, redis_class=_AsyncSentinelRedis,
                               connection_pool_class=_BlockingSentinelConnectionPool,
                               max_connections=max_connections, timeout=timeout, **_primary_kwargs(target), **kwargs)
