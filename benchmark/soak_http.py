"""The soak's only way to the server: a URL check that keeps it on loopback, and one aiohttp session whose every
request carries the hang timeout."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import aiohttp


def loopback_url(url: str) -> str:
    """`url` without a trailing slash; SystemExit unless it is plain http to a loopback address."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    loopback = host == "localhost"
    try:
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if parts.scheme != "http" or not loopback or parts.port is None:
        raise SystemExit(
            f"soak.py only targets a server on this machine: --url must be http://127.0.0.1:PORT (or localhost), "
            f"got {url!r}"
        )
    return url.rstrip("/")


class Http:
    """One aiohttp session against the server; every request carries the per-request hang timeout. Redirects are
    not followed (and aiohttp ignores proxy settings by default), so nothing leaves the loopback address."""

    def __init__(self, base: str, timeout_s: float, connections: int) -> None:
        self.base = base
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections))

    async def close(self) -> None:
        await self.session.close()

    async def post(self, path: str, body: object = None, raw: bytes | None = None) -> tuple[int, bytes]:
        data = raw if raw is not None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        async with self.session.post(
            self.base + path, data=data, headers=headers, timeout=self.timeout, allow_redirects=False
        ) as resp:
            return resp.status, await resp.read()

    async def get(self, path: str) -> tuple[int, bytes]:
        async with self.session.get(self.base + path, timeout=self.timeout, allow_redirects=False) as resp:
            return resp.status, await resp.read()

    async def stream(
        self, path: str, body: dict, on_first: Callable[[], Awaitable[None]] | None = None, hang_up: bool = False
    ) -> tuple[int, list[str]]:
        """The `data:` payloads of a streamed reply. `on_first` runs after the first one; `hang_up` closes the
        connection there instead of reading on."""
        async with self.session.post(self.base + path, json=body, timeout=self.timeout, allow_redirects=False) as resp:
            if resp.status != 200:
                return resp.status, [(await resp.read()).decode(errors="replace")]
            events: list[str] = []
            async for line in resp.content:
                text = line.decode().strip()
                if not text.startswith("data:"):
                    continue
                events.append(text[5:].strip())
                if len(events) == 1:
                    if hang_up:
                        resp.close()
                        return resp.status, events
                    if on_first is not None:
                        await on_first()
            return resp.status, events
