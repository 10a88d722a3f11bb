"""A person's saved SSH keys: add and delete, each audited.

A saved key opens the running instances of every tenant where its person's role may operate
workloads (``scheduling.selectors.access``), so its creation and deletion are written to the audit
log of each tenant the person belongs to, where that tenant's admins read them.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction

from nodes.agent.workload_rules import WorkloadRuleError, parse_ssh_public_key
from portal.actors import Actor
from portal.errors import ValidationFailed
from portal.models import Membership, User
from portal.services.audit import audit_record
from scheduling.models import SshKey

MAX_KEYS_PER_PERSON = 100


def _fail(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", fields={field: [message]})


def _audit(*, user: User, actor: Actor, action: str, key: SshKey) -> None:
    data = {"name": key.name, "fingerprint": key.fingerprint, "person": user.email}
    tenants = [m.tenant for m in Membership.objects.filter(user=user).select_related("tenant")]
    for tenant in tenants or [None]:
        audit_record(tenant=tenant, actor=actor, action=action, target=key, data=data)


def ssh_key_create(*, user: User | None, name: str, public_key: str, actor: Actor) -> SshKey:
    """Validate the name and the key (ed25519, ECDSA or RSA of 2048 bits or more), save it for
    ``user``; a 400 naming the field otherwise."""
    if user is None:
        raise _fail("public_key", "This token acts for no person, and keys are saved per person.")
    if not isinstance(name, str) or not name.strip():
        raise _fail("name", "Give the key a name.")
    name = name.strip()
    if len(name) > 100 or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise _fail("name", "At most 100 characters, without control characters.")
    try:
        parsed = parse_ssh_public_key(public_key, field="public_key")
    except WorkloadRuleError as exc:
        raise _fail(exc.field, exc.message) from None
    with transaction.atomic():
        if SshKey.objects.for_person(user).count() >= MAX_KEYS_PER_PERSON:
            raise _fail("public_key", f"At most {MAX_KEYS_PER_PERSON} saved keys per person.")
        try:
            with transaction.atomic():
                key = SshKey.objects.create(
                    user=user, name=name, public_key=parsed.line, fingerprint=parsed.fingerprint
                )
        except IntegrityError:
            raise _fail("public_key", f"This key ({parsed.fingerprint}) is already saved.") from None
        _audit(user=user, actor=actor, action="ssh_key.create", key=key)
    return key


@transaction.atomic
def ssh_key_delete(*, key: SshKey, actor: Actor) -> None:
    """Delete a saved key: the next login with it is refused (the agent asks at each login)."""
    _audit(user=key.user, actor=actor, action="ssh_key.delete", key=key)
    key.delete()
