"""The staff scheduling API: ``/api/staff/v1/regions/`` lists each region's queue policy and
``/api/staff/v1/regions/<code>/`` reads or changes it (PATCH ``{"queue_policy": "sjf"}``, and/or
``{"queue_policy_by_plan": {"spot": "fcfs"}}``, the whole per-plan map).

Staff only, like the finance API: a staff session, or a staff token with ``scheduling:write``; a
tenant's token gets 403. A bad value answers 400 naming its field and changes nothing.
"""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework.authentication import SessionAuthentication
from rest_framework.response import Response
from rest_framework.views import APIView

from nodes.models import QueuePolicy, Region
from portal.actors import actor_from_request
from portal.api.authentication import BearerTokenAuthentication, StaffTokenAuthentication
from portal.api.permissions import StaffPermission
from portal.errors import ValidationFailed
from portal.models import StaffScope
from scheduling.services.queue_policy import UNSET, region_queue_policy_set


def _region(r: Region) -> dict:
    return {
        "code": r.code,
        "name": r.name,
        "queue_policy": r.queue_policy,
        "queue_policy_by_plan": r.queue_policy_by_plan,
        "choices": QueuePolicy.values,
    }


class StaffSchedulingBase(APIView):
    # Tenant tokens are authenticated only so that StaffPermission can refuse them with a reason.
    authentication_classes = [StaffTokenAuthentication, BearerTokenAuthentication, SessionAuthentication]
    permission_classes = [StaffPermission]
    staff_scope = StaffScope.SCHEDULING_WRITE


class RegionListApi(StaffSchedulingBase):
    @extend_schema(operation_id="staff_v1_regions_list", responses={200: dict})
    def get(self, request):
        return Response({"results": [_region(r) for r in Region.objects.order_by("code")]})


class RegionApi(StaffSchedulingBase):
    @extend_schema(responses={200: dict})
    def get(self, request, code: str):
        return Response(_region(get_object_or_404(Region, code=code)))

    @extend_schema(request=dict, responses={200: dict})
    def patch(self, request, code: str):
        region = get_object_or_404(Region, code=code)
        data = request.data if isinstance(request.data, dict) else None
        allowed = {"queue_policy", "queue_policy_by_plan"}
        if data is None or not data or set(data) - allowed:
            unknown = sorted(set(data) - allowed) if data else []
            name = str(unknown[0])[:40] if unknown else "queue_policy"
            raise ValidationFailed(
                f"{name}: send queue_policy and/or queue_policy_by_plan only.",
                fields={name: ["Only queue_policy and queue_policy_by_plan can be changed here."]},
            )
        region_queue_policy_set(
            region=region,
            policy=data.get("queue_policy", UNSET),
            by_plan=data.get("queue_policy_by_plan", UNSET),
            actor=actor_from_request(request),
        )
        return Response(_region(region))
