"""Which URLs and addresses a delivery may go to (plain functions; the API and the sender use them)."""

from __future__ import annotations

import ipaddress

import pytest

from webhooks.targets import TargetRefused, address_refusal, target_addresses, target_parse


@pytest.mark.parametrize(
    "address",
    [
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "127.0.0.1",
        "127.8.9.10",
        "169.254.169.254",  # cloud metadata
        "100.64.0.1",  # shared (CGNAT)
        "0.0.0.0",
        "224.0.0.1",
        "255.255.255.255",
        "::1",
        "::",
        "fe80::1",
        "fc00::1",
        "fd12:3456::1",
        "::ffff:10.0.0.1",  # IPv4-mapped
        "::ffff:127.0.0.1",
        "2002:a9fe:a9fe::1",  # 6to4 around 169.254.169.254
        "64:ff9b::a00:1",  # NAT64 around 10.0.0.1
        "ff02::1",
    ],
)
def test_private_loopback_and_link_local_addresses_are_refused(address):
    assert address_refusal(ipaddress.ip_address(address), allow_loopback=False)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_pass(address):
    assert address_refusal(ipaddress.ip_address(address), allow_loopback=False) is None


def test_the_setting_allows_loopback_only():
    assert address_refusal(ipaddress.ip_address("127.0.0.1"), allow_loopback=True) is None
    assert address_refusal(ipaddress.ip_address("::1"), allow_loopback=True) is None
    assert address_refusal(ipaddress.ip_address("10.0.0.1"), allow_loopback=True)
    assert address_refusal(ipaddress.ip_address("169.254.169.254"), allow_loopback=True)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://example.com/", "scheme"),
        ("http://example.com/hook", "https"),
        ("file:///etc/passwd", "scheme"),
        ("https://", "no host"),
        ("https://user:pw@example.com/", "user name"),
        ("https://example.com@10.0.0.1/", "user name"),
        ("https://10.0.0.1/hook", "private"),
        ("https://[::1]/hook", "loopback"),
        ("https://169.254.169.254/latest/meta-data", "link-local"),
        ("https://[::ffff:127.0.0.1]/", "loopback"),
        ("https://localhost/hook", "full DNS name"),
        ("https://intranet/hook", "full DNS name"),
        ("https://2130706433/", "full DNS name"),
        ("https://127.1/", "neither"),
        ("https://0x7f.0.0.1/", "neither"),
        ("https://exa mple.com/", "printable"),
        ("https://example.com/a\nb", "printable"),
        ("https://exämple.com/", "printable"),
        ("https://example.com/#frag", "fragment"),
        ("https://example.com:99999/", "valid URL"),
        ("https://example.com:0/", "Port 0"),
        ("https://-bad-.com/", "valid DNS name"),
        ("https://example.com/" + "a" * 2000, "2000"),
        (None, "Must be a URL"),
        (["https://example.com/"], "Must be a URL"),
        ("", "Must be a URL"),
    ],
)
def test_hostile_urls_are_refused_saying_why(url, why):
    with pytest.raises(TargetRefused, match=why):
        target_parse(url, allow_loopback=False)


def test_a_good_url_keeps_its_path_query_and_port():
    t = target_parse("https://hooks.example.com:8443/in/gpupool?team=a", allow_loopback=False)
    assert (t.scheme, t.host, t.port, t.target) == ("https", "hooks.example.com", 8443, "/in/gpupool?team=a")
    assert t.host_header == "hooks.example.com:8443"
    assert target_parse("https://example.com", allow_loopback=False).target == "/"


def test_a_name_is_resolved_and_every_address_checked():
    # localhost is a name the resolver answers with a loopback address: refused unless allowed,
    # whatever the URL looked like when the endpoint was saved.
    target = target_parse("http://localhost:9/hook", allow_loopback=True)
    assert [str(a) for a in target_addresses(target, allow_loopback=True)] in (
        ["127.0.0.1"],
        ["127.0.0.1", "::1"],
        ["::1", "127.0.0.1"],
    )
    with pytest.raises(TargetRefused, match=r"localhost resolves to .*loopback"):
        target_addresses(target, allow_loopback=False)
    with pytest.raises(TargetRefused, match="does not resolve"):
        target_addresses(
            target_parse("https://no-such-host.invalid/", allow_loopback=False), allow_loopback=False
        )
