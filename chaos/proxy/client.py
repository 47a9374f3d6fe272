"""An async Toxiproxy client for the harness: ours or a real `toxiproxy-server` alike.

Only the 2.x HTTP API is used, so the harness can drive either server. An answer other
than success raises `ToxiproxyError(status, message)` with the server's own message
(status 0: the server could not be reached).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from chaos.proxy.model import ProxySpec, ToxicSpec


class ToxiproxyError(Exception):
    """The API refused a call: `status` is its HTTP status (0: no answer at all)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        first = self.message.strip().splitlines()[0] if self.message.strip() else "no message"
        return f"toxiproxy: {first} (HTTP {self.status})" if self.status else f"toxiproxy: {first}"


class ToxiproxyClient:
    """`async with ToxiproxyClient("http://127.0.0.1:8474") as tp: await tp.proxies()`."""

    def __init__(self, url: str = "http://127.0.0.1:8474", *, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ToxiproxyClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.request(method, self.url + path, json=body) as resp:
                text = await resp.text()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            why = str(exc) or type(exc).__name__
            raise ToxiproxyError(0, f"cannot reach {self.url}: {why}") from None
        data: Any = None
        if text.strip():
            try:
                data = json.loads(text)
            except ValueError:
                data = text
        if status >= 400:
            message = data.get("error", text) if isinstance(data, dict) else text
            raise ToxiproxyError(status, str(message))
        return data

    # server

    async def version(self) -> str:
        """The server's version (2.x answers JSON, older releases plain text)."""
        data = await self._call("GET", "/version")
        return str(data["version"]) if isinstance(data, dict) else str(data).strip()

    async def reset(self) -> None:
        """Enable every proxy and remove every toxic."""
        await self._call("POST", "/reset")

    # proxies

    async def proxies(self) -> dict[str, dict[str, Any]]:
        return dict(await self._call("GET", "/proxies"))

    async def create_proxy(
        self, name: str, upstream: str, listen: str = "127.0.0.1:0", enabled: bool = True
    ) -> dict[str, Any]:
        """The proxy as created (`listen` shows the real port when 0 was asked for)."""
        body = {"name": name, "upstream": upstream, "listen": listen, "enabled": enabled}
        return dict(await self._call("POST", "/proxies", body))

    async def get_proxy(self, name: str) -> dict[str, Any]:
        return dict(await self._call("GET", f"/proxies/{name}"))

    async def update_proxy(self, name: str, **fields: Any) -> dict[str, Any]:
        """Change `listen`, `upstream` or `enabled`. PATCH, or POST for releases before
        PATCH existed (they answer 405)."""
        try:
            return dict(await self._call("PATCH", f"/proxies/{name}", fields))
        except ToxiproxyError as exc:
            if exc.status != 405:
                raise
        return dict(await self._call("POST", f"/proxies/{name}", fields))

    async def delete_proxy(self, name: str) -> None:
        await self._call("DELETE", f"/proxies/{name}")

    async def populate(self, proxies: list[ProxySpec | dict[str, Any]]) -> list[dict[str, Any]]:
        """Create or replace the proxies (those unchanged are kept as they are)."""
        body = [p.model_dump() if isinstance(p, ProxySpec) else p for p in proxies]
        data = await self._call("POST", "/populate", body)
        return list(data["proxies"])

    # toxics

    async def toxics(self, proxy: str) -> list[dict[str, Any]]:
        return list(await self._call("GET", f"/proxies/{proxy}/toxics"))

    async def add_toxic(self, proxy: str, spec: ToxicSpec | dict[str, Any]) -> dict[str, Any]:
        body = spec.wire() if isinstance(spec, ToxicSpec) else spec
        return dict(await self._call("POST", f"/proxies/{proxy}/toxics", body))

    async def get_toxic(self, proxy: str, name: str) -> dict[str, Any]:
        return dict(await self._call("GET", f"/proxies/{proxy}/toxics/{name}"))

    async def update_toxic(self, proxy: str, name: str, **fields: Any) -> dict[str, Any]:
        """Change `toxicity` and `attributes` (merged into the current ones)."""
        path = f"/proxies/{proxy}/toxics/{name}"
        try:
            return dict(await self._call("PATCH", path, fields))
        except ToxiproxyError as exc:
            if exc.status != 405:
                raise
        return dict(await self._call("POST", path, fields))

    async def remove_toxic(self, proxy: str, name: str) -> None:
        await self._call("DELETE", f"/proxies/{proxy}/toxics/{name}")
