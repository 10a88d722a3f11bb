from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from portal.actors import Actor
from tests.webhooks.receiver import Receiver
from webhooks.services.endpoints import endpoint_create


@pytest.fixture
def loopback(settings):
    """Deliveries to this machine's loopback (the receiver), as tests and demos allow."""
    settings.WEBHOOK_ALLOW_LOOPBACK = True
    settings.WEBHOOK_TIMEOUT_S = 5.0
    settings.WEBHOOK_CONNECT_TIMEOUT_S = 2.0
    return settings


@pytest.fixture
def receiver():
    with Receiver() as r:
        yield r


@pytest.fixture
def make_endpoint(loopback):
    def make(tenant, url: str, event_types=("*",), receiver: Receiver | None = None):
        endpoint, secret = endpoint_create(
            tenant=tenant, url=url, event_types=list(event_types), actor=Actor.system()
        )
        if receiver is not None:
            receiver.secret = secret
        return endpoint, secret

    return make


def wait_for(check: Callable[[], object], timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} not met in {timeout} s")


from tests.portal.conftest import add_member, owner_client, signed_in  # noqa: E402, F401
