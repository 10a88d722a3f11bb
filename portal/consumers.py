from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from portal.events import STAFF_GROUP, tenant_group
from portal.middleware import SESSION_TENANT_KEY


class EventsConsumer(AsyncJsonWebsocketConsumer):
    """One socket per browser session, carrying only its active tenant's events (and, for staff,
    the fleet's)."""

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        session = self.scope.get("session")
        tenant_id = await self._tenant_id(user, session.get(SESSION_TENANT_KEY) if session else None)
        self.groups_joined: list[str] = []
        if tenant_id is not None:
            self.groups_joined.append(tenant_group(tenant_id))
        if user.is_staff:
            self.groups_joined.append(STAFF_GROUP)
        if not self.groups_joined:
            await self.close(code=4403)
            return
        for group in self.groups_joined:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()

    async def disconnect(self, code):
        for group in getattr(self, "groups_joined", []):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def gpupool_event(self, message):
        await self.send_json(message["event"])

    async def gpupool_events(self, message):
        """Several events in one message (``portal.events.publish_many``), sent in order."""
        for event in message["events"]:
            await self.send_json(event)

    @database_sync_to_async
    def _tenant_id(self, user, chosen):
        from portal.selectors import membership_active

        membership = membership_active(user=user, tenant_id=chosen)
        return membership.tenant_id if membership else None
