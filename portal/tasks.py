from celery import shared_task

from portal.services.idempotency import idempotency_keys_purge_expired
from portal.services.invitations import invitations_purge_expired


@shared_task(name="portal.tasks.purge_expired_invitations")
def purge_expired_invitations() -> int:
    return invitations_purge_expired()


@shared_task(name="portal.tasks.purge_expired_idempotency_keys")
def purge_expired_idempotency_keys() -> int:
    return idempotency_keys_purge_expired()
