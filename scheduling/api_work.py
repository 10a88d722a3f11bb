"""``/api/v1/work/``: the work queue's endpoint, called by a work-queue array's workers
(``scheduling.services.work``), authenticated by the task's own signed token
(``Authorization: Bearer $GPUPOOL_WORK_TOKEN``), never by a tenant's API token or a session."""

from __future__ import annotations

from django.urls import path
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.api.routers import extra_urlpatterns
from scheduling.models import WorkItem, Workload
from scheduling.services.work import RETRY_AFTER_S, work_done, work_next, work_renew, work_task_for_token


class WorkItemSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    first = serializers.IntegerField(help_text="The item's first frame.")
    last = serializers.IntegerField(help_text="Its last frame (inclusive).")
    lease_expires_at = serializers.DateTimeField()


class WorkNextSerializer(serializers.Serializer):
    item = WorkItemSerializer(allow_null=True)
    done = serializers.BooleanField(help_text="Every item is done: the worker may end.")
    retry_after_s = serializers.IntegerField(
        allow_null=True, help_text="No item now, but some are leased to others: ask again after this."
    )


def _item(item: WorkItem) -> dict:
    return {
        "index": item.index,
        "first": item.first,
        "last": item.last,
        "lease_expires_at": item.lease_expires_at,
    }


class _WorkView(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes: list = []

    def task(self, request) -> Workload:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        return work_task_for_token(token.strip() if scheme.lower() == "bearer" else None)


class WorkNextView(_WorkView):
    @extend_schema(request=None, responses=WorkNextSerializer, auth=[])
    def post(self, request):
        """Lease the next item to the calling worker."""
        item, done = work_next(task=self.task(request), now=timezone.now())
        body = {
            "item": _item(item) if item else None,
            "done": done,
            "retry_after_s": None if item or done else RETRY_AFTER_S,
        }
        return Response(WorkNextSerializer(body).data)


class WorkItemDoneView(_WorkView):
    @extend_schema(request=None, responses=WorkItemSerializer, auth=[])
    def post(self, request, index: int):
        """Mark an item leased to the calling worker done."""
        item = work_done(task=self.task(request), index=index, now=timezone.now())
        return Response(WorkItemSerializer(_item(item)).data)


class WorkItemRenewView(_WorkView):
    @extend_schema(request=None, responses=WorkItemSerializer, auth=[])
    def post(self, request, index: int):
        """Extend the calling worker's lease on an item."""
        item = work_renew(task=self.task(request), index=index, now=timezone.now())
        return Response(WorkItemSerializer(_item(item)).data)


extra_urlpatterns += [
    path("work/next/", WorkNextView.as_view(), name="work-next"),
    path("work/items/<int:index>/done/", WorkItemDoneView.as_view(), name="work-item-done"),
    path("work/items/<int:index>/renew/", WorkItemRenewView.as_view(), name="work-item-renew"),
]
