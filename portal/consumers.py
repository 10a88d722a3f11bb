from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from portal.events import STAFF_GROUP, tenant_group, user_group
from portal.middleware import SESSION_TENANT_KEY

CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403


class EventsConsumer(AsyncJsonWebsocketConsumer):
    """One socket per browser session, carrying only its active tenant's events that the person's
    role may see (and, for staff, the fleet's). It follows the person: a change to their
    memberships or account (``portal.events.membership_changed``) makes it look again, leave the
    groups the person lost, and close once they are no longer a member."""

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.user_id = user.pk
        self.groups_joined: set[str] = set()
        session = self.scope.get("session")
        chosen = session.get(SESSION_TENANT_KEY) if session else None
        self.tenant_id, groups = await self._first_look(user, chosen)
        if not groups:
            await self.close(code=CLOSE_FORBIDDEN)
            return
        await self._follow(groups | {user_group(self.user_id)})
        await self.accept()

    async def disconnect(self, code):
        await self._follow(set())

    async def gpupool_event(self, message):
        if message.get("group") in self.groups_joined:  # not one queued before the socket left it
            await self.send_json(message["event"])

    async def gpupool_events(self, message):
        """Several events in one message (``portal.events.publish_many``), sent in order."""
        if message.get("group") in self.groups_joined:
            for event in message["events"]:
                await self.send_json(event)

    async def gpupool_membership(self, message):
        """The person's memberships or account changed: keep only what they may still see."""
        groups = await self._groups(self.tenant_id)
        if not groups:
            await self._follow(set())
            await self.close(code=CLOSE_FORBIDDEN)
            return
        await self._follow(groups | {user_group(self.user_id)})

    async def _follow(self, groups: set[str]) -> None:
        for group in self.groups_joined - groups:
            await self.channel_layer.group_discard(group, self.channel_name)
        for group in groups - self.groups_joined:
            await self.channel_layer.group_add(group, self.channel_name)
        self.groups_joined = set(groups)

    @database_sync_to_async
    def _first_look(self, user, chosen) -> tuple[int | None, set[str]]:
        """The tenant this socket is for (the session's, else the person's first) and its groups."""
        from portal.selectors import membership_active

        membership = membership_active(user=user, tenant_id=chosen)
        tenant_id = membership.tenant_id if membership else None
        return tenant_id, self._groups_now(tenant_id)

    @database_sync_to_async
    def _groups(self, tenant_id) -> set[str]:
        return self._groups_now(tenant_id)

    def _groups_now(self, tenant_id) -> set[str]:
        """The groups of the scopes the person's current role in the tenant holds, and the staff
        group while they are staff; nothing when the account is inactive."""
        from portal.models import Membership, User

        user = User.objects.filter(pk=self.user_id, is_active=True).first()
        if user is None:
            return set()
        groups = {STAFF_GROUP} if user.is_staff else set()
        if tenant_id is not None:
            membership = Membership.objects.filter(tenant_id=tenant_id, user=user).only("role").first()
            if membership is not None:
                groups |= {tenant_group(tenant_id, scope) for scope in membership.scopes}
        return groups
