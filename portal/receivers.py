"""Portal's own receivers, connected in ``PortalConfig.ready()``."""

from __future__ import annotations

import time

from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.db.models.signals import post_delete, post_save, pre_save
from django.dispatch import receiver

from portal.actors import Actor
from portal.events import membership_changed
from portal.middleware import STAFF_LAST_SEEN_KEY
from portal.models import Membership, User
from portal.ratelimit import client_ip
from portal.services.audit import audit_record
from portal.signin import retry_after


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


# --- sign-in and passwords: audited wherever they happen (site, admin, reset links) ------------------


@receiver(user_logged_in, dispatch_uid="portal.signed_in")
def _signed_in(sender, request, user, **kwargs) -> None:
    audit_record(
        tenant=None,
        actor=Actor(user=user),
        action="account.signed_in",
        target=user,
        data={"ip": client_ip(request) if request is not None else ""},
    )
    if user.is_staff and request is not None and hasattr(request, "session"):
        # The idle clock starts at sign-in, in the session write sign-in makes anyway, so the first
        # page after it does not write the session again (StaffIdleTimeoutMiddleware).
        request.session[STAFF_LAST_SEEN_KEY] = int(time.time())


@receiver(user_login_failed, dispatch_uid="portal.sign_in_failed")
def _sign_in_failed(sender, credentials, request=None, **kwargs) -> None:
    """A wrong password, or an attempt the limiter refused (a lockout: the password was not checked)."""
    locked = bool(retry_after(request))
    audit_record(
        tenant=None,
        actor=Actor.system(),
        action="account.sign_in_locked" if locked else "account.sign_in_failed",
        data={
            "email": str(credentials.get("username") or credentials.get("email") or "")[:254].lower(),
            "ip": client_ip(request) if request is not None else "",
        },
    )


@receiver(pre_save, sender=User, dispatch_uid="portal.user_password_check")
def _password_check(sender, instance: User, update_fields=None, **kwargs) -> None:
    if instance.pk is None or (update_fields is not None and "password" not in update_fields):
        return
    stored = User.objects.filter(pk=instance.pk).values_list("password", flat=True).first()
    instance._password_was_changed = stored is not None and stored != instance.password


@receiver(post_save, sender=User, dispatch_uid="portal.user_password_changed")
def _password_changed(sender, instance: User, created: bool, **kwargs) -> None:
    """A password changed by any way (a reset link, the admin, ``changepassword``)."""
    if not created and getattr(instance, "_password_was_changed", False):
        instance._password_was_changed = False
        audit_record(tenant=None, actor=Actor.system(), action="account.password_changed", target=instance)
