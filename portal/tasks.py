from celery import shared_task

from portal.services.invitations import invitations_purge_expired


@shared_task(name="portal.tasks.purge_expired_invitations")
def purge_expired_invitations() -> int:
    return invitations_purge_expired()
