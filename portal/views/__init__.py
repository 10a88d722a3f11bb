"""The web shell's views. ``TenantScopedMixin`` and ``PanelView`` are for other apps' pages too."""

from portal.views.base import (
    PanelView,
    TenantScopedMixin,
    bad_request,
    forbidden,
    htmx_partial,
    not_found,
    render_page,
)

__all__ = [
    "PanelView",
    "TenantScopedMixin",
    "bad_request",
    "forbidden",
    "htmx_partial",
    "not_found",
    "render_page",
]
