"""What every app's admin actions share."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from django.contrib import admin, messages

from portal.actors import Actor
from portal.errors import DomainError


def run_each(modeladmin, request, queryset: Iterable, fn: Callable, verb: str) -> None:
    """Apply a service to each selected object as the signed-in staff member: a refusal (a
    DomainError) is reported for its object and the others go on; the count done is reported."""
    actor = Actor(user=request.user)
    done = 0
    for obj in queryset:
        try:
            fn(obj, actor)
            done += 1
        except DomainError as exc:
            modeladmin.message_user(request, f"{obj}: {exc.message}", messages.ERROR)
    if done:
        modeladmin.message_user(request, f"{verb} {done} item(s).", messages.SUCCESS)


class RecordAdmin(admin.ModelAdmin):
    """Records the system writes (events, usage, prices, metrics): staff look, filter and search;
    nobody adds, edits or deletes them here, since services own them."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
