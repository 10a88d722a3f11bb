from celery import shared_task

from portal import services


@shared_task(name="portal.tasks.purge_expired_invitations")
def purge_expired_invitations() -> int:
    return services.invitations_purge_expired()
