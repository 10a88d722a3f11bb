"""Staff-only access for the fleet pages: anonymous people sign in first, everyone else gets 403."""

from __future__ import annotations

from django.contrib.auth.mixins import AccessMixin

from portal.actors import Actor, actor_from_request
from portal.views.base import forbidden


class StaffRequiredMixin(AccessMixin):
    """Fleet objects are not tenant-owned: only staff see them, whatever team they are in."""

    def dispatch(self, request, *args, **kwargs):
        if not request.user.is_authenticated:
            return self.handle_no_permission()
        if not request.user.is_staff:
            return forbidden(request, "The fleet pages are for gpupool staff.")
        return super().dispatch(request, *args, **kwargs)

    @property
    def actor(self) -> Actor:
        return actor_from_request(self.request)
