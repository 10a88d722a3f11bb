"""``gpupool.webhooks.verify``, a receiver's check of a delivery: good, tampered, replayed,
malformed and rolled-secret signatures, held to the portal's own signing (``webhooks.signature``),
and importable without the server. The end-to-end deliveries that it checks are in
tests/webhooks/test_delivery_worker.py."""

from __future__ import annotations

import hashlib
import hmac
import json
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool import GpupoolError
from gpupool.errors import WebhookSignatureError
from gpupool.webhooks import HEADER, sign, signature_timestamp, verify
from tests.client.conftest import ROOT
from webhooks import signature as server

SECRET = "whsec_Vb3NbT1aT2cT9s2pX1lq0m4o3Qk5yZ7r8u9w0e1r2t3"
EVENT = {"id": "evt_12", "type": "workload.state", "created": "2026-12-07T02:00:00+00:00",
         "data": {"workload_id": 7, "from": "queued", "to": "running"}}  # fmt: skip
BODY = json.dumps(EVENT, separators=(",", ":")).encode()


def test_a_delivery_signed_by_the_portal_verifies_and_answers_the_event():
    now = int(time.time())
    header = server.sign(SECRET, BODY, timestamp=now)  # exactly what the sender puts in the header
    assert HEADER == server.HEADER == "Gpupool-Signature"
    assert verify(BODY, header, SECRET) == EVENT
    assert verify(bytearray(BODY), header, SECRET) == EVENT
    assert verify(BODY, header.encode(), SECRET) == EVENT  # a header handed over as bytes
    assert signature_timestamp(BODY, header, SECRET) == now
    # The scheme, recomputed by hand: HMAC-SHA256 of "t.body" under the whole secret text.
    digest = hmac.new(SECRET.encode(), f"{now}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert header == f"t={now},v1={digest}" == sign(BODY, SECRET, now)


@given(
    secret=st.text(min_size=1, max_size=60),
    body=st.binary(max_size=300),
    timestamp=st.integers(min_value=0, max_value=10**11),
)
def test_the_client_and_the_portal_sign_alike(secret, body, timestamp):
    assert sign(body, secret, timestamp) == server.sign(secret, body, timestamp)
    assert server.verify(secret, body, sign(body, secret, timestamp), tolerance_s=0) == timestamp
    assert (
        signature_timestamp(body, server.sign(secret, body, timestamp), secret, tolerance_s=None) == timestamp
    )


@pytest.mark.parametrize(
    ("body", "secret"),
    [
        (BODY.replace(b"running", b"stopped"), SECRET),  # tampered payload
        (BODY + b" ", SECRET),  # one byte more
        (BODY, "whsec_another"),  # another endpoint's secret
        (BODY, SECRET + " "),
    ],
)
def test_a_tampered_payload_or_another_secret_is_a_mismatch(body, secret):
    header = server.sign(SECRET, BODY)
    with pytest.raises(WebhookSignatureError, match="No signature matches") as refused:
        verify(body, header, secret)
    assert refused.value.reason == "mismatch" and isinstance(refused.value, GpupoolError)


def test_a_forged_timestamp_or_signature_is_a_mismatch():
    old = int(time.time()) - 3600
    header = server.sign(SECRET, BODY, timestamp=old)
    digest = header.split("v1=")[1]
    # A replay with a fresh timestamp but the old signature: the signature covers the timestamp.
    with pytest.raises(WebhookSignatureError) as forged:
        verify(BODY, f"t={int(time.time())},v1={digest}", SECRET)
    assert forged.value.reason == "mismatch"
    flipped = digest[:-1] + ("0" if digest[-1] != "0" else "1")
    with pytest.raises(WebhookSignatureError, match="No signature matches"):
        verify(BODY, f"t={old},v1={flipped}", SECRET, tolerance_s=None)
    with pytest.raises(WebhookSignatureError, match="No signature matches"):
        verify(BODY, f"t={old},v1={digest.upper()}", SECRET, tolerance_s=None)


def test_an_old_or_future_timestamp_is_refused_within_the_receivers_tolerance():
    now = time.time()
    old = server.sign(SECRET, BODY, timestamp=int(now) - 301)
    with pytest.raises(WebhookSignatureError, match="more than 300 s") as replay:
        verify(BODY, old, SECRET)
    assert replay.value.reason == "too_old"
    future = server.sign(SECRET, BODY, timestamp=int(now) + 301)
    with pytest.raises(WebhookSignatureError, match="more than 300 s"):
        verify(BODY, future, SECRET)
    # The positive controls: within the tolerance, a wider one, or none at all.
    assert verify(BODY, server.sign(SECRET, BODY, timestamp=int(now) - 290), SECRET) == EVENT
    assert verify(BODY, old, SECRET, tolerance_s=600) == EVENT
    assert verify(BODY, old, SECRET, tolerance_s=None) == EVENT
    assert verify(BODY, old, SECRET, tolerance_s=60, now=now - 301) == EVENT
    with pytest.raises(ValueError, match="tolerance_s"):
        verify(BODY, old, SECRET, tolerance_s=-1)


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (None, "missing"),
        ("", "missing"),
        ("garbage", "malformed"),
        ("v1=abc", "malformed"),
        ("t=1700000000", "malformed"),
        ("t=abc,v1=00", "malformed"),
        ("t=-5,v1=00", "malformed"),
        ("t=\u0661\u0667,v1=00", "malformed"),  # digits, but not ASCII ones
        ("t=99999999999999,v1=00", "malformed"),
        ("t=1700000000,v0=00", "malformed"),  # another scheme only
        ("t=1700000000,v1=é", "mismatch"),
        ("t=1700000000,v1=", "mismatch"),
    ],
)
def test_a_missing_or_malformed_header_is_refused_saying_why(header, reason):
    with pytest.raises(WebhookSignatureError) as refused:
        verify(BODY, header, SECRET, tolerance_s=None)
    assert refused.value.reason == reason and str(refused.value)


def test_several_signatures_and_several_secrets_while_a_secret_is_rolled():
    t = int(time.time())
    new = "whsec_new-secret"
    # A header with more than one v1 (signed under two secrets): one match is enough, either way.
    header = f"t={t},v1={server.compute(new, BODY, t)},v1={server.compute(SECRET, BODY, t)}"
    assert verify(BODY, header, SECRET) == EVENT
    assert verify(BODY, header, new) == EVENT
    # A receiver holding the old and the new secret accepts deliveries signed with either.
    assert verify(BODY, server.sign(new, BODY), [new, SECRET]) == EVENT
    assert verify(BODY, server.sign(SECRET, BODY), (s for s in [new, SECRET])) == EVENT
    with pytest.raises(WebhookSignatureError, match="No signature matches"):
        verify(BODY, server.sign("whsec_third", BODY), [new, SECRET])


def test_wrong_arguments_are_errors_of_the_caller():
    header = server.sign(SECRET, BODY)
    with pytest.raises(TypeError, match="raw bytes"):
        verify(BODY.decode(), header, SECRET)
    with pytest.raises(TypeError):
        verify({"id": 1}, header, SECRET)
    for secret in ("", [], [""], None):
        with pytest.raises(ValueError, match="signing secret"):
            verify(BODY, header, secret)


def test_a_signed_payload_that_is_not_a_json_object_is_refused():
    for body in (b"[1, 2]", b"not json", b"\xff\xfe"):
        with pytest.raises(WebhookSignatureError) as refused:
            verify(body, server.sign(SECRET, body), SECRET)
        assert refused.value.reason == "not_json"


def test_a_receiver_needs_no_server_code():
    code = (
        "import sys; from gpupool.webhooks import verify, sign; "
        "body = b'{\"id\": \"evt_1\"}'; print(verify(body, sign(body, 'whsec_x'), 'whsec_x')); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'django', 'portal', 'webhooks', 'scheduling', 'metering', 'nodes', 'rest_framework'}))"
    )
    env = {"PYTHONPATH": str(ROOT / "client" / "src"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/",
                         timeout=60, check=True)  # fmt: skip
    assert out.stdout.splitlines() == ["{'id': 'evt_1'}", "[]"]
