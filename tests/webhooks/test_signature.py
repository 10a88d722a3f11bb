"""The signature scheme, from the receiver's side (``webhooks.signature.verify``)."""

from __future__ import annotations

import hashlib
import hmac
import time

import pytest

from tests.conftest import python_run
from webhooks.signature import SignatureError, compute, sign, verify

SECRET = "whsec_test-secret"
BODY = b'{"id":"evt_1","type":"workload.state","data":{"to":"running"}}'


def test_the_header_is_stripes_scheme_and_verifies():
    header = sign(SECRET, BODY, timestamp=1_700_000_000)
    t, _, v1 = header.partition(",")
    assert t == "t=1700000000"
    # Recomputed here by hand: HMAC-SHA256 of "t.body" under the whole secret text.
    expected = hmac.new(SECRET.encode(), b"1700000000." + BODY, hashlib.sha256).hexdigest()
    assert v1 == f"v1={expected}"
    assert verify(SECRET, BODY, header, now=1_700_000_100) == 1_700_000_000


@pytest.mark.parametrize(
    ("secret", "body", "why"),
    [
        ("whsec_other", BODY, "No signature matches"),
        (SECRET, BODY + b" ", "No signature matches"),
        (SECRET, BODY.replace(b"running", b"stopped"), "No signature matches"),
    ],
)
def test_another_secret_or_a_changed_body_is_refused(secret, body, why):
    header = sign(SECRET, BODY)
    with pytest.raises(SignatureError, match=why):
        verify(secret, body, header)


def test_an_old_timestamp_is_refused_and_the_tolerance_is_the_receivers():
    header = sign(SECRET, BODY, timestamp=int(time.time()) - 3600)
    with pytest.raises(SignatureError, match="more than 300 s"):
        verify(SECRET, BODY, header)
    assert verify(SECRET, BODY, header, tolerance_s=7200)
    # A re-signed timestamp without the secret does not match.
    forged = header.replace(header.split(",")[0], f"t={int(time.time())}")
    with pytest.raises(SignatureError, match="No signature matches"):
        verify(SECRET, BODY, forged)


@pytest.mark.parametrize(
    "header",
    [
        "",
        None,
        "v1=abc",
        "t=123",
        "t=abc,v1=00",
        "t=1,v2=00",
        "garbage",
        "t=99999999999999,v1=00",
        "t=1,v1=é",
    ],
)
def test_malformed_headers_are_refused(header):
    with pytest.raises(SignatureError):
        verify(SECRET, BODY, header, tolerance_s=0)


def test_one_matching_signature_among_several_and_rotated_secrets():
    t = int(time.time())
    header = f"t={t},v1={'0' * 64},v1={compute(SECRET, BODY, t)}"
    assert verify(SECRET, BODY, header) == t
    assert verify(["whsec_old", SECRET], BODY, sign(SECRET, BODY)) > 0
    with pytest.raises(TypeError):
        verify(SECRET, BODY.decode(), sign(SECRET, BODY))


def test_the_module_imports_nothing_of_django():
    # The client package exposes it to receivers that have no Django.
    result = python_run(
        "import sys, webhooks.signature as s; "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('django', 'portal')], sorted(sys.modules); "
        "print(s.sign('k', b'x', 1))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"t=1,v1={compute('k', b'x', 1)}"


def test_a_header_signed_with_several_secrets_has_one_v1_each_in_order():
    header = sign(["whsec_new", "whsec_old"], BODY, timestamp=1_700_000_000)
    assert header == (
        f"t=1700000000,v1={compute('whsec_new', BODY, 1_700_000_000)},v1={compute('whsec_old', BODY, 1_700_000_000)}"
    )
    for secret in ("whsec_new", "whsec_old"):
        assert verify(secret, BODY, header, now=1_700_000_000) == 1_700_000_000
    with pytest.raises(ValueError):
        sign([], BODY)
