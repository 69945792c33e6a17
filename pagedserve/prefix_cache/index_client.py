"""`IndexClient`: a gateway's `PrefixLookup` through the prefix cache service's HTTP API."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import httpx


class IndexClient:
    """Asks the service (index_service.py) which workers hold a prompt's leading blocks. Any
    failure (down, slow, bad answer) raises, and the caller routes by load instead."""

    def __init__(self, url: str, timeout: float = 0.05):
        self._client = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout)

    async def cached_blocks(self, block_hashes: Sequence[bytes]) -> Mapping[str, int]:
        if not block_hashes:
            return {}
        response = await self._client.post("/lookup", content=b"".join(block_hashes),
                                           headers={"Content-Type": "application/octet-stream"})
        response.raise_for_status()
        workers = response.json()["workers"]
        if not isinstance(workers, dict) or not all(isinstance(n, int) for n in workers.values()):
            raise ValueError(f"the prefix cache service answered {workers!r}")
        return workers

    async def aclose(self) -> None:
        await self._client.aclose()
