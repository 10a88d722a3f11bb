"""The demo data ``make run`` starts with: one tenant, its owner and a member, and a staff admin."""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction

from portal.actors import Actor
from portal.models import Membership, Role, Tenant, User
from portal.services.accounts import user_get_or_create
from portal.services.audit import audit_record
from portal.services.tenants import tenant_create

DEMO_TENANT_SLUG = "demo"
DEMO_PASSWORD = "gpupool-demo"


@dataclass(frozen=True)
class DemoLogin:
    email: str
    role: str


DEMO_LOGINS = (
    DemoLogin("owner@demo.gpupool.test", "tenant owner"),
    DemoLogin("member@demo.gpupool.test", "tenant member"),
    DemoLogin("admin@gpupool.test", "staff admin"),
)


@transaction.atomic
def demo_seed() -> Tenant:
    """Idempotent: a second run changes nothing."""
    system = Actor.system()
    tenant = Tenant.objects.filter(slug=DEMO_TENANT_SLUG).first()
    if tenant is None:
        tenant = tenant_create(
            slug=DEMO_TENANT_SLUG,
            name="Demo Lab",
            owner_email=DEMO_LOGINS[0].email,
            owner_password=DEMO_PASSWORD,
            billing_email="billing@demo.gpupool.test",
            actor=system,
        )
    member, _ = user_get_or_create(email=DEMO_LOGINS[1].email, password=DEMO_PASSWORD)
    if not Membership.objects.filter(tenant=tenant, user=member).exists():
        m = Membership.objects.create(tenant=tenant, user=member, role=Role.MEMBER)
        audit_record(tenant=tenant, actor=system, action="member.add", target=m, data={"role": m.role})
    if not User.objects.filter(email=DEMO_LOGINS[2].email).exists():
        User.objects.create_superuser(
            email=DEMO_LOGINS[2].email, password=DEMO_PASSWORD, full_name="Staff Admin"
        )
    return tenant
