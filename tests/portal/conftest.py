"""Fixtures for the web shell tests: members with a role, and signed-in test clients."""

from __future__ import annotations

import pytest
from django.test import Client

from portal.middleware import SESSION_TENANT_KEY
from portal.models import Membership, Role, Tenant, User

PASSWORD = "pw-for-tests-1"


@pytest.fixture
def add_member(db):
    """``add_member(tenant, role, email=None)``: a new (or existing) person in ``tenant``."""

    def add(tenant: Tenant, role: str = Role.MEMBER, email: str | None = None) -> Membership:
        email = email or f"{role}-{Membership.objects.count()}@{tenant.slug}.test"
        user = User.objects.filter(email=email).first() or User.objects.create_user(
            email=email, password=PASSWORD, full_name=f"{role.title()} Person"
        )
        return Membership.objects.create(tenant=tenant, user=user, role=role)

    return add


@pytest.fixture
def signed_in(db):
    """``signed_in(user, tenant=None)``: a test client with the person signed in and ``tenant`` active."""

    def sign_in(user: User, tenant: Tenant | None = None) -> Client:
        client = Client()
        client.force_login(user)
        if tenant is not None:
            session = client.session
            session[SESSION_TENANT_KEY] = tenant.pk
            session.save()
        return client

    return sign_in


@pytest.fixture
def owner_client(signed_in, owner, tenant) -> Client:
    return signed_in(owner, tenant)


HTMX = {"HTTP_HX_REQUEST": "true"}


def eight_h100_node():
    """The seeded catalog and one ready node of eight H100s in us-east-1; the H100 model."""
    import uuid

    from django.utils import timezone

    from nodes.catalog import catalog_seed
    from nodes.models import Gpu, GpuModel, Node, NodeState, Region

    catalog_seed()
    region = Region.objects.create(code="us-east-1", name="US East", location="Ashburn")
    node = Node.objects.create(
        hostname="gpu-0001", region=region, cpu_cores=96, ram_mib=1024 * 1024,
        state=NodeState.READY, last_heartbeat_at=timezone.now(),
    )  # fmt: skip
    h100 = GpuModel.objects.get(short_name="H100")
    Gpu.objects.bulk_create(
        Gpu(node=node, index=i, uuid=f"GPU-{uuid.uuid4()}", model=h100, reported_name=h100.name,
            memory_mib=h100.memory_gib * 1024)
        for i in range(8)
    )  # fmt: skip
    return h100
