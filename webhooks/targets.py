"""Where a webhook may be delivered: the URL's rules and the address check. Plain Python.

A target URL is ``https://`` (``http://`` only where loopback is allowed, for tests and demos)
with a host name of at least two labels whose last is not all digits, or an IP literal; no user
name or password, no fragment, nothing but printable ASCII. The URL is checked when an endpoint is
saved and again before every delivery, and every address its name resolves to must be public
(``address_refusal``): not private, loopback (unless allowed), link-local, multicast, reserved,
shared (CGNAT) or unspecified, including IPv4 addresses wrapped in IPv6 (mapped, 6to4, Teredo,
NAT64). The sender then connects to one of the addresses it checked, never resolving again.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_URL_LENGTH = 2000
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class TargetRefused(ValueError):
    """The URL or an address it resolves to may not receive deliveries; the message says why."""


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str  # a name, or an IP address without brackets
    port: int
    target: str  # path and query, as sent on the request line
    literal: IPAddress | None  # the host when it is an IP address

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_refusal(ip: IPAddress, *, allow_loopback: bool) -> str | None:
    """Why ``ip`` may not receive a delivery (``"<ip> is a private address"``), or None."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_v4(ip)
        if inner is not None:
            why = address_refusal(inner, allow_loopback=allow_loopback)
            return f"{why} (inside {ip})" if why else None
    kind = None
    if ip.is_loopback:
        kind = None if allow_loopback else "a loopback address"
    elif ip.is_unspecified:
        kind = "the unspecified address"
    elif ip.is_link_local:
        kind = "a link-local address"
    elif ip.is_multicast:
        kind = "a multicast address"
    elif ip.is_private:
        kind = "a private address"
    elif ip.is_reserved or not ip.is_global:
        kind = "not a public address"
    return f"{ip} is {kind}" if kind else None


def _host_check(host: str, *, allow_loopback: bool) -> IPAddress | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        why = address_refusal(ip, allow_loopback=allow_loopback)
        if why:
            raise TargetRefused(f"{why}: webhooks go to public addresses only.")
        return ip
    if len(host) > 253:
        raise TargetRefused("The host name is longer than 253 characters.")
    labels = host.rstrip(".").split(".")
    if not all(_LABEL.fullmatch(label) for label in labels):
        raise TargetRefused("The host is not a valid DNS name (ASCII letters, digits and -; use punycode).")
    if host.lower() == "localhost" and allow_loopback:
        return None
    if len(labels) < 2:
        raise TargetRefused("The host must be a full DNS name (example.com), not a single label.")
    if labels[-1].isdigit():
        raise TargetRefused("The host is neither a DNS name nor an IP address in standard form.")
    return None


def target_parse(url: object, *, allow_loopback: bool) -> Target:
    """The checked parts of ``url``; raises ``TargetRefused`` saying what is wrong."""
    if not isinstance(url, str) or not url:
        raise TargetRefused("Must be a URL.")
    if len(url) > MAX_URL_LENGTH:
        raise TargetRefused(f"At most {MAX_URL_LENGTH} characters.")
    if not url.isascii() or any(not c.isprintable() or c.isspace() for c in url):
        raise TargetRefused("Only printable ASCII without spaces (percent-encode the rest).")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise TargetRefused(f"Not a valid URL ({exc}).") from None
    scheme = parts.scheme.lower()
    if scheme not in ("https", "http"):
        raise TargetRefused("The scheme must be https.")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise TargetRefused("A user name or password in the URL is not allowed; check the signature instead.")
    if parts.fragment or url.endswith("#"):
        raise TargetRefused("A fragment (#...) is not allowed.")
    host = parts.hostname or ""
    if not host:
        raise TargetRefused("The URL has no host.")
    if port == 0:
        raise TargetRefused("Port 0 is not a port.")
    literal = _host_check(host, allow_loopback=allow_loopback)
    if scheme == "http" and not allow_loopback:
        raise TargetRefused("The scheme must be https (plain http is for local tests only).")
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return Target(
        scheme=scheme,
        host=host,
        port=port or (443 if scheme == "https" else 80),
        target=target,
        literal=literal,
    )


def target_addresses(target: Target, *, allow_loopback: bool) -> list[IPAddress]:
    """Every address the target's host resolves to, each checked: raises ``TargetRefused`` when
    one of them is refused (a name with one private address among public ones is refused whole)
    or the name does not resolve."""
    if target.literal is not None:
        return [target.literal]
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise TargetRefused(f"{target.host} does not resolve ({exc}).") from None
    addresses: list[IPAddress] = []
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if ip not in addresses:
            addresses.append(ip)
    if not addresses:
        raise TargetRefused(f"{target.host} resolves to no address.")
    for ip in addresses:
        why = address_refusal(ip, allow_loopback=allow_loopback)
        if why:
            raise TargetRefused(
                f"{target.host} resolves to {ip}: {why}; webhooks go to public addresses only."
            )
    return addresses
