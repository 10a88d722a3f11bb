"""Portal's own receivers, connected in ``PortalConfig.ready()``."""

from __future__ import annotations

from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from portal.events import membership_changed
from portal.models import Membership, User


@receiver(post_save, sender=Membership, dispatch_uid="portal.membership_saved")
@receiver(post_delete, sender=Membership, dispatch_uid="portal.membership_deleted")
def _membership_changed(sender, instance: Membership, **kwargs) -> None:
    """However a membership changes (a service, a cascade), the person's live sockets follow it."""
    membership_changed(user_id=instance.user_id)


@receiver(post_save, sender=User, dispatch_uid="portal.user_saved")
def _user_saved(sender, instance: User, created: bool, update_fields=None, **kwargs) -> None:
    """An account deactivated or losing staff: its live sockets look again."""
    if created or (update_fields is not None and not {"is_active", "is_staff"} & set(update_fields)):
        return
    membership_changed(user_id=instance.pk)
