"""The web shell's two registries: dashboard panels and navigation entries.

Portal draws the frame; every app adds its own panels and navigation entries from its
``AppConfig.ready()``, so portal never imports the apps that draw into it::

    from portal.dashboard import register_nav, register_panel

    class NodesConfig(AppConfig):
        def ready(self):
            register_nav("fleet", "Fleet", "nodes:fleet", order=40, icon="server")
            register_panel("fleet-health", "Fleet health", "nodes:panel-health", order=20)

A panel is an htmx partial: the dashboard renders an empty card whose body loads the panel's URL
(``hx-get`` on ``load``). The view behind ``url_name`` takes no URL arguments, answers the request's
tenant only (use ``portal.views.PanelView``) and returns the card's body.

Registering the same name again replaces the earlier entry, so a module imported twice (or reloaded
by the dev server) does not show an entry twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.urls import NoReverseMatch, reverse

from portal.models import Scope

# Icons the base layout draws (an SVG sprite in templates/portal/_icons.html).
ICONS = frozenset(
    {"grid", "users", "key", "server", "cpu", "layers", "receipt", "chart", "shield", "settings", "dot"}
)


@dataclass(frozen=True)
class Panel:
    name: str
    title: str
    url_name: str
    order: int = 100
    scope: str | None = None  # the membership scope needed to see it; None: every member
    wide: bool = False  # spans the whole row of the dashboard grid

    @property
    def url(self) -> str:
        return reverse(self.url_name)


@dataclass(frozen=True)
class NavItem:
    name: str
    label: str
    url_name: str
    order: int = 100
    scope: str | None = None  # the membership scope needed to see it; None: every member
    icon: str = "dot"
    staff_only: bool = False  # shown to staff users only (e.g. the Django admin)

    @property
    def url(self) -> str:
        return reverse(self.url_name)


_panels: dict[str, Panel] = {}
_nav: dict[str, NavItem] = {}


def _check(name: str, scope: str | None) -> None:
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"Use letters, digits, '-' and '_' in a registry name, not {name!r}.")
    if scope is not None and scope not in Scope.values:
        raise ValueError(f"Unknown scope {scope!r}; choose from {', '.join(Scope.values)}.")


def register_panel(
    name: str,
    title: str,
    url_name: str,
    order: int = 100,
    *,
    scope: str | None = None,
    wide: bool = False,
) -> Panel:
    """Add a dashboard panel; lower ``order`` comes first. Returns the registered panel."""
    _check(name, scope)
    panel = Panel(name=name, title=title, url_name=url_name, order=order, scope=scope, wide=wide)
    _panels[name] = panel
    return panel


def unregister_panel(name: str) -> None:
    _panels.pop(name, None)


def register_nav(
    name: str,
    label: str,
    url_name: str,
    order: int = 100,
    *,
    scope: str | None = None,
    icon: str = "dot",
    staff_only: bool = False,
) -> NavItem:
    """Add an entry to the sidebar; lower ``order`` comes first. Returns the registered entry."""
    _check(name, scope)
    if icon not in ICONS:
        raise ValueError(f"Unknown icon {icon!r}; choose from {', '.join(sorted(ICONS))}.")
    item = NavItem(
        name=name, label=label, url_name=url_name, order=order, scope=scope, icon=icon, staff_only=staff_only
    )
    _nav[name] = item
    return item


def unregister_nav(name: str) -> None:
    _nav.pop(name, None)


def _allowed(scope: str | None, membership) -> bool:
    if scope is None:
        return membership is not None
    return membership is not None and scope in membership.scopes


def panels_for(membership) -> list[Panel]:
    """The panels this member may see, in order; none without a membership."""
    return sorted(
        (p for p in _panels.values() if _allowed(p.scope, membership)), key=lambda p: (p.order, p.name)
    )


@dataclass(frozen=True)
class NavLink:
    name: str
    label: str
    url: str
    icon: str
    active: bool


def nav_for(request) -> list[NavLink]:
    """The sidebar for this request: entries the person may use, the current one marked active."""
    user = getattr(request, "user", None)
    membership = getattr(request, "membership", None)
    links: list[NavLink] = []
    for item in sorted(_nav.values(), key=lambda i: (i.order, i.name)):
        if item.staff_only:
            if not (user is not None and user.is_staff):
                continue
        elif not _allowed(item.scope, membership):
            continue
        try:
            url = item.url
        except NoReverseMatch:
            continue  # an app registered an entry whose URLs are not mounted (e.g. in a test)
        active = request.path == url if url == "/" else request.path.startswith(url)
        links.append(NavLink(name=item.name, label=item.label, url=url, icon=item.icon, active=active))
    return links


# --- portal's own entries ------------------------------------------------------------------------------

register_nav("dashboard", "Dashboard", "portal:dashboard", order=0, icon="grid")
register_nav("team", "Team", "portal:team", order=80, icon="users")
register_nav("secrets", "Secrets", "portal:secrets", order=85, icon="key")
register_nav("tokens", "API tokens", "portal:tokens", order=90, scope=Scope.ADMIN, icon="key")
register_nav("admin", "Admin", "admin:index", order=1000, icon="shield", staff_only=True)

register_panel("getting-started", "Getting started", "portal:panel-getting-started", order=10)
register_panel("team", "Team", "portal:panel-team", order=80)
register_panel("activity", "Recent activity", "portal:panel-activity", order=90, scope=Scope.ADMIN)
