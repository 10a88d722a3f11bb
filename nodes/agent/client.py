"""HTTP to the portal (``nodes/PROTOCOL.md``), and how the agent reads the answers."""

from __future__ import annotations

import random
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from nodes.agent import __version__

# What to do with an answer.
OK = "ok"  # 2xx: done, drop it from the buffer
RETRY = "retry"  # portal unreachable, 5xx, 3xx, timeout, 408/425/429: keep it, try again later
REAUTH = "reauth"  # 401: the credential is not (or no longer) valid
BAD = "bad"  # other 4xx: the portal will never take this; dead-letter it

TRANSIENT_4XX = frozenset({408, 425, 429})


def classify(status_code: int) -> str:
    if 200 <= status_code < 300:
        return OK
    if status_code == 401:
        return REAUTH
    if 300 <= status_code < 400:
        return RETRY  # never followed (see PortalClient.request): nothing was delivered
    if status_code >= 500 or status_code in TRANSIENT_4XX:
        return RETRY
    return BAD


@dataclass(frozen=True, slots=True)
class PortalResponse:
    """An answer of the portal, read whole (the protocol's bodies are small)."""

    status_code: int
    content: bytes

    def json(self) -> Any:
        """The body as JSON; ValueError if it is not."""
        return orjson.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


def error_text(response: PortalResponse) -> str:
    """The ``{"error": {"code", "message"}}`` of an answer, or its first bytes."""
    try:
        data = response.json()
        error = data.get("error") if isinstance(data, dict) else None
        if isinstance(error, dict):
            fields = error.get("fields")
            suffix = f" {fields}" if fields else ""
            return f"{response.status_code} {error.get('code', '')}: {error.get('message', '')}{suffix}"
    except ValueError:
        pass
    return f"{response.status_code}: {response.text[:300]}"


class PortalUnreachable(Exception):
    """No HTTP answer: connection refused or reset, DNS, timeout."""


class Backoff:
    """Exponential backoff with jitter: the n-th delay is between half and all of
    ``min(maximum, initial * 2**n)``."""

    def __init__(self, initial: float, maximum: float, rng: random.Random | None = None) -> None:
        self.initial = initial
        self.maximum = maximum
        self.attempt = 0
        self.rng = rng or random.Random()

    def next(self) -> float:
        ceiling = min(self.maximum, self.initial * (2**self.attempt))
        self.attempt = min(self.attempt + 1, 32)
        return ceiling / 2 + self.rng.uniform(0, ceiling / 2)

    def reset(self) -> None:
        self.attempt = 0


# How long an idle connection to the portal is kept: longer than the heartbeat interval (10 s), so
# consecutive heartbeats reuse one connection instead of a TCP (and, in production, TLS) handshake
# each; shorter than the portal's keep-alive (deploy/: uvicorn --timeout-keep-alive=75, as nginx's
# default), so the server never closes a connection the agent is about to reuse. Behind a server
# that closes sooner (uvicorn's own default is 5 s) the closed connection is seen before it is used
# and a new one is opened.
KEEPALIVE_S = 30.0


def proxy_for(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTPS_PROXY``/``HTTP_PROXY``, ``NO_PROXY``),
    as most HTTP clients read it; read once, where aiohttp's ``trust_env`` reads the environment (and
    ~/.netrc) again for every request."""
    parts = urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
        return proxy
    return None


class PortalClient:
    """The agent's HTTP client (aiohttp). Made inside the agent's event loop; one connection pool.

    aiohttp rather than httpx: under ``bench/scale.py`` the simulated fleet's 500 agents used 0.52
    cores with httpx and 0.44 with aiohttp (httpcore polls every pooled connection before each
    request, and looks for sniffio with an import that fails every time); on a GPU server that CPU
    is the tenant's.
    """

    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")  # paths are appended, as to a prefix
        self.timeout_s = timeout_s
        self.proxy = proxy_for(self.base_url)
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S),
            headers={"User-Agent": f"gpupool-agent/{__version__}"},
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        credential: str | None = None,
        json: Any = None,
        content: str | None = None,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> PortalResponse:
        """``json``: a value to encode; ``content``: a body already encoded as JSON."""
        headers = {"Authorization": f"Node {credential}"} if credential else {}
        body = None
        if json is not None:
            body = orjson.dumps(json)
        elif content is not None:
            body = content.encode()
        if body is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self.http.request(
                method,
                self.base_url + path,
                data=body,
                params={k: str(v) for k, v in params.items()} if params else None,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s or self.timeout_s),
                proxy=self.proxy,
                # A redirect could lead a node's credential and tenants' payloads to plain HTTP or
                # to another host: the agent goes only where its portal URL says.
                allow_redirects=False,
            ) as response:
                return PortalResponse(response.status, await response.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PortalUnreachable(f"{type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        await self.http.close()
