"""One HTTP delivery to a checked address: plain Python on httpcore.

The URL is checked (``targets.target_parse``), its name resolved once and every address checked
(``targets.target_addresses``); the connection then goes to a checked address itself (a network
backend that ignores the name it is given), while the Host header, TLS SNI and certificate check
use the URL's name. Redirects are never followed (httpcore follows none; a 3xx is a failed
attempt). The whole attempt is bounded by ``timeout_s`` and at most ``max_response_bytes`` of the
answer are read; what is kept of it is a short excerpt for the delivery log.
"""

from __future__ import annotations

import functools
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass

import httpcore

from webhooks.targets import IPAddress, TargetRefused, target_addresses, target_parse

EXCERPT_BYTES = 1024
USER_AGENT = "gpupool-webhooks/1"


@dataclass(frozen=True)
class Outcome:
    status: int | None  # the HTTP status, None when no answer came
    latency_ms: int
    error: str  # empty when the receiver answered 2xx
    excerpt: str  # the start of the answer's body, as text
    address: str  # the address connected to ("" when none was)

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


class _PinnedBackend(httpcore.NetworkBackend):
    """Connects to ``address`` whatever host name the pool asks for (it asks for the URL's)."""

    def __init__(self, address: IPAddress) -> None:
        self._address = str(address)
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return self._inner.connect_tcp(
            self._address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
        )

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise httpcore.ConnectError("Webhooks never use Unix sockets.")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


@functools.cache
def _default_ssl_context() -> ssl.SSLContext:
    """One verifying context per process: making one loads the CA bundle (about 0.1 s)."""
    return ssl.create_default_context()


def _ms(start: float) -> int:
    return int((time.monotonic() - start) * 1000)


def post(
    url: str,
    body: bytes,
    headers: Iterable[tuple[str, str]],
    *,
    allow_loopback: bool,
    timeout_s: float,
    connect_timeout_s: float,
    max_response_bytes: int,
    ssl_context: ssl.SSLContext | None = None,
) -> Outcome:
    """POST ``body`` to ``url`` under the rules above. Never raises for what the network or the
    receiver does: the outcome says what happened."""
    start = time.monotonic()
    deadline = start + timeout_s
    try:
        target = target_parse(url, allow_loopback=allow_loopback)
        addresses = target_addresses(target, allow_loopback=allow_loopback)
    except TargetRefused as exc:
        return Outcome(None, _ms(start), f"refused: {exc}", "", "")
    request_headers = [
        ("Host", target.host_header),
        ("User-Agent", USER_AGENT),
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(body))),
        *headers,
    ]
    origin_url = httpcore.URL(
        scheme=target.scheme.encode(),
        host=target.host.encode(),
        port=target.port,
        target=target.target.encode(),
    )
    error = ""
    for address in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        timeouts = {"connect": min(connect_timeout_s, left), "read": left, "write": left, "pool": left}
        try:
            with (
                httpcore.ConnectionPool(
                    ssl_context=ssl_context or _default_ssl_context(),
                    max_connections=1,
                    network_backend=_PinnedBackend(address),
                ) as pool,
                pool.stream(
                    "POST",
                    origin_url,
                    headers=request_headers,
                    content=body,
                    extensions={"timeout": timeouts},
                ) as response,
            ):
                read, cut, chunks = 0, False, []
                for chunk in response.iter_stream():
                    if read < EXCERPT_BYTES:
                        chunks.append(chunk[: EXCERPT_BYTES - read])
                    read += len(chunk)
                    if read > max_response_bytes:
                        cut = True
                        break
                    if time.monotonic() > deadline:
                        raise httpcore.ReadTimeout("The answer took longer than the delivery timeout.")
                status = response.status
                location = {k.lower(): v for k, v in response.headers}.get(b"location", b"")
        except httpcore.ConnectError as exc:
            error = f"connect to {address}: {exc or 'refused'}"
            continue  # the next checked address, if any
        except httpcore.TimeoutException as exc:
            return Outcome(None, _ms(start), f"timeout: {exc or 'no answer in time'}", "", str(address))
        except (httpcore.NetworkError, httpcore.ProtocolError, ssl.SSLError, OSError) as exc:
            return Outcome(None, _ms(start), f"{type(exc).__name__}: {exc}"[:500], "", str(address))
        excerpt = b"".join(chunks)[:EXCERPT_BYTES].decode("utf-8", "replace")
        error = ""
        if 300 <= status < 400:
            error = f"redirect ({status}) to {location.decode('latin-1')[:200] or '?'} not followed"
        elif not 200 <= status < 300:
            error = f"HTTP {status}"
        if cut:
            error = (error + "; " if error else "") + f"answer over {max_response_bytes} bytes, cut"
            if 200 <= status < 300:
                error = ""  # the receiver said yes; only the rest of its answer was dropped
        return Outcome(status, _ms(start), error, excerpt, str(address))
    return Outcome(None, _ms(start), error or "timeout: no time left to connect", "", "")
