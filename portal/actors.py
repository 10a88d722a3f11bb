"""Who is acting: a person, an API token acting for a tenant, or the system itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from portal.models import ApiToken, User


@dataclass(frozen=True)
class Actor:
    user: User | None = None
    token: ApiToken | None = None

    @classmethod
    def system(cls) -> Actor:
        return cls()

    @property
    def kind(self) -> str:
        if self.token is not None:
            return "token"
        if self.user is not None:
            return "user"
        return "system"

    def __str__(self) -> str:
        if self.token is not None:
            return f"token {self.token.name} ({self.token.display_prefix})"
        if self.user is not None:
            return self.user.email
        return "system"


def actor_from_request(request) -> Actor:
    from portal.models import ApiToken

    auth = getattr(request, "auth", None)
    if isinstance(auth, ApiToken):
        return Actor(user=auth.created_by, token=auth)
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return Actor(user=user)
    return Actor.system()
