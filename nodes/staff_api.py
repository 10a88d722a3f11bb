"""The staff rollout API, ``/api/staff/v1/rollouts/``: list and start rolling-upgrade campaigns, read
one with its nodes' progress, and pause, resume or abort it (``POST .../<id>/pause/`` and so on,
with an optional ``{"reason": "..."}``).

Staff only, like the other staff APIs: a staff session, or a staff token with ``fleet:write``; a
tenant's token gets 403. The rules are ``nodes.services.rollouts``'; a bad field answers 400 naming
it and writes nothing, an action the campaign's state does not allow answers 409.

``/api/staff/v1/gpus/<id>/mig/`` reads a GPU's MIG mode, layout and the profiles its model offers;
PATCH ``{"enable": true, "profiles": ["3g.40gb", "3g.40gb"], "reason": "..."}`` asks its agent to set
them (``nodes.services.mig``): 200 with the command when the GPU is idle; 202 when work holds it
(the GPU drains: it takes no new work, its work runs on, and the command goes when the last of it
has ended; ``pending`` says what waits and for which workloads); 409 when a change is pending
already. ``enable: false`` leaves MIG mode. ``POST .../mig/cancel/`` drops a change that still
waits (409 once it was sent). Same access (``fleet:write``); a bad layout answers 400 naming its
field and changes nothing.
"""

from __future__ import annotations

from django.db.models import Count, Prefetch
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status, viewsets
from rest_framework.authentication import SessionAuthentication
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from nodes.mig_profiles import table_for
from nodes.models import Gpu, RolloutCampaign, RolloutStep, RolloutStepState
from nodes.services import rollouts
from nodes.services.mig import gpu_mig_cancel, gpu_mig_configure, gpu_mig_waiting_for
from portal.actors import actor_from_request
from portal.api.authentication import BearerTokenAuthentication, StaffTokenAuthentication
from portal.api.permissions import StaffPermission
from portal.errors import ValidationFailed
from portal.models import StaffScope


class RolloutStepSerializer(serializers.ModelSerializer):
    hostname = serializers.CharField(source="node.hostname")
    region = serializers.CharField(source="node.region.code")
    node_state = serializers.CharField(source="node.state")

    class Meta:
        model = RolloutStep
        fields = [
            "node_id", "hostname", "region", "node_state", "position", "batch", "state", "message",
            "drain_started_at", "drain_deadline_at", "finished_at",
        ]  # fmt: skip
        read_only_fields = fields


class RolloutCampaignSerializer(serializers.ModelSerializer):
    gpu_model = serializers.CharField(source="gpu_model.name", allow_null=True, default=None)
    region = serializers.CharField(source="region.code", allow_null=True, default=None)
    label = serializers.SerializerMethodField()
    created_by = serializers.CharField(source="created_by.email", allow_null=True, default=None)
    progress = serializers.SerializerMethodField()

    class Meta:
        model = RolloutCampaign
        fields = [
            "id", "name", "upgrade", "gpu_model", "region", "label", "batch_size", "max_region_share",
            "drain_deadline_s", "step_timeout_s", "state", "state_reason", "batches_started", "progress",
            "created_by", "created_at", "updated_at", "finished_at",
        ]  # fmt: skip
        read_only_fields = fields

    def get_label(self, obj: RolloutCampaign) -> str | None:
        return f"{obj.label_key}={obj.label_value}" if obj.label_key else None

    def get_progress(self, obj: RolloutCampaign) -> dict[str, int]:
        counts = getattr(obj, "step_counts", None)
        if counts is None:
            counts = dict(obj.steps.values_list("state").annotate(n=Count("id")).order_by())
        return {state: counts.get(state, 0) for state in RolloutStepState.values}


class RolloutDetailSerializer(RolloutCampaignSerializer):
    steps = RolloutStepSerializer(many=True, read_only=True)

    class Meta(RolloutCampaignSerializer.Meta):
        fields = [*RolloutCampaignSerializer.Meta.fields, "steps"]
        read_only_fields = fields


class RolloutCreateSerializer(serializers.Serializer):
    """What a start takes (the schema's request). The service checks every field again."""

    name = serializers.CharField(max_length=100)
    upgrade = serializers.CharField(
        max_length=64, help_text="The name of an upgrade in the agents' `upgrades` table; never a command."
    )
    gpu_model = serializers.CharField(required=False, help_text="A catalog model's name or short name.")
    region = serializers.CharField(required=False, help_text="A region's code.")
    label = serializers.CharField(required=False, help_text="key=value, matched against the nodes' labels.")
    batch_size = serializers.IntegerField(min_value=1, max_value=rollouts.MAX_BATCH_SIZE)
    max_region_share = serializers.CharField(
        help_text='The most of a region out of service at once: a fraction ("0.25") or a percentage ("25%").'
    )
    drain_deadline_s = serializers.IntegerField(min_value=0, max_value=rollouts.MAX_DRAIN_DEADLINE_S)
    step_timeout_s = serializers.IntegerField(
        required=False, min_value=rollouts.MIN_STEP_TIMEOUT_S, max_value=rollouts.MAX_STEP_TIMEOUT_S
    )


ReasonSerializer = inline_serializer(
    name="RolloutActionRequest", fields={"reason": serializers.CharField(required=False, max_length=2000)}
)


def _reason(request) -> str:
    data = request.data if isinstance(request.data, dict) else None
    if data is None:
        raise ValidationFailed("body: expected an object.", fields={"body": ["Expected an object."]})
    unknown = sorted(str(k)[:40] for k in set(data) - {"reason"})
    if unknown:
        raise ValidationFailed(f"{unknown[0]}: only reason.", fields={unknown[0]: ["Only reason is taken."]})
    reason = data.get("reason", "")
    if not isinstance(reason, str) or len(reason) > 2000 or "\x00" in reason:
        raise ValidationFailed(
            "reason: text, at most 2000 characters.", fields={"reason": ["At most 2000 characters."]}
        )
    return reason.strip()


class RolloutViewSet(viewsets.GenericViewSet):
    # Tenant tokens are authenticated only so that StaffPermission can refuse them with a reason.
    authentication_classes = [StaffTokenAuthentication, BearerTokenAuthentication, SessionAuthentication]
    permission_classes = [StaffPermission]
    staff_scope = StaffScope.FLEET_WRITE
    filter_backends: list = []
    pagination_class = None
    serializer_class = RolloutCampaignSerializer
    lookup_value_regex = r"[0-9]+"

    def get_queryset(self):
        return RolloutCampaign.objects.select_related("gpu_model", "region", "created_by")

    def _campaign(self, pk) -> RolloutCampaign:
        return get_object_or_404(self.get_queryset(), pk=pk)

    @extend_schema(
        operation_id="staff_v1_rollouts_list", responses={200: RolloutCampaignSerializer(many=True)}
    )
    def list(self, request):
        campaigns = list(self.get_queryset()[:200])
        counts: dict[int, dict[str, int]] = {}
        for campaign_id, state, n in (
            RolloutStep.objects.filter(campaign__in=campaigns)
            .values_list("campaign_id", "state")
            .annotate(n=Count("id"))
            .order_by()
        ):
            counts.setdefault(campaign_id, {})[state] = n
        for campaign in campaigns:
            campaign.step_counts = counts.get(campaign.pk, {})
        return Response({"results": RolloutCampaignSerializer(campaigns, many=True).data})

    @extend_schema(request=RolloutCreateSerializer, responses={201: RolloutDetailSerializer})
    def create(self, request):
        campaign = rollouts.rollout_start(data=request.data, actor=actor_from_request(request))
        return Response(
            RolloutDetailSerializer(self._detail(campaign.pk)).data, status=status.HTTP_201_CREATED
        )

    @extend_schema(responses={200: RolloutDetailSerializer})
    def retrieve(self, request, pk=None):
        return Response(RolloutDetailSerializer(self._detail(pk)).data)

    def _detail(self, pk) -> RolloutCampaign:
        steps = RolloutStep.objects.select_related("node__region").order_by("position")
        return get_object_or_404(
            self.get_queryset().prefetch_related(Prefetch("steps", queryset=steps)), pk=pk
        )

    def _act(self, request, pk, service):
        reason = _reason(request)
        service(campaign=self._campaign(pk), actor=actor_from_request(request), reason=reason)
        return Response(RolloutDetailSerializer(self._detail(pk)).data)

    @extend_schema(request=ReasonSerializer, responses={200: RolloutDetailSerializer})
    @action(detail=True, methods=["post"])
    def pause(self, request, pk=None):
        return self._act(request, pk, rollouts.rollout_pause)

    @extend_schema(request=ReasonSerializer, responses={200: RolloutDetailSerializer})
    @action(detail=True, methods=["post"])
    def resume(self, request, pk=None):
        return self._act(request, pk, rollouts.rollout_resume)

    @extend_schema(request=ReasonSerializer, responses={200: RolloutDetailSerializer})
    @action(detail=True, methods=["post"])
    def abort(self, request, pk=None):
        return self._act(request, pk, rollouts.rollout_abort)


def gpu_mig_state(gpu: Gpu) -> dict:
    table = table_for(gpu.model.name if gpu.model_id else gpu.reported_name)
    pending = None
    if gpu.mig_pending is not None:
        pending = {
            "state": "sent" if gpu.mig_sent_at is not None else "draining",
            "enable": gpu.mig_pending.get("enable"),
            "layout": gpu.mig_pending.get("layout") or [],
            "reason": gpu.mig_pending.get("reason", ""),
            "requested_by": gpu.mig_pending.get("requested_by", ""),
            "requested_at": gpu.mig_requested_at.isoformat() if gpu.mig_requested_at else None,
            "sent_at": gpu.mig_sent_at.isoformat() if gpu.mig_sent_at else None,
            "command": gpu.mig_pending.get("command"),
            "waiting_for": gpu_mig_waiting_for(gpu=gpu),
        }
    return {
        "gpu": gpu.pk,
        "node": gpu.node.hostname,
        "index": gpu.index,
        "uuid": gpu.uuid,
        "model": gpu.model.name if gpu.model_id else gpu.reported_name,
        "mig_capable": table is not None,
        "profiles": list(table.names) if table is not None else [],
        "mig_mode": gpu.mig_mode,
        "layout": gpu.mig_layout,
        "configuring": gpu.mig_configuring,
        "pending": pending,
    }


def _gpu(pk: int) -> Gpu:
    return get_object_or_404(Gpu.objects.select_related("node", "model"), pk=pk, removed_at__isnull=True)


class GpuMigApi(APIView):
    # Tenant tokens are authenticated only so that StaffPermission can refuse them with a reason.
    authentication_classes = [StaffTokenAuthentication, BearerTokenAuthentication, SessionAuthentication]
    permission_classes = [StaffPermission]
    staff_scope = StaffScope.FLEET_WRITE

    @extend_schema(operation_id="staff_v1_gpu_mig_read", responses={200: dict})
    def get(self, request, pk: int):
        return Response(gpu_mig_state(_gpu(pk)))

    @extend_schema(operation_id="staff_v1_gpu_mig_configure", request=dict, responses={200: dict, 202: dict})
    def patch(self, request, pk: int):
        gpu = _gpu(pk)
        data = request.data if isinstance(request.data, dict) else None
        allowed = {"enable", "profiles", "reason"}
        if not data or "enable" not in data or set(data) - allowed:
            unknown = sorted(set(data) - allowed) if data else []
            name = str(unknown[0])[:40] if unknown else "enable"
            raise ValidationFailed(
                f"{name}: send enable, and profiles and reason if you like.",
                fields={name: ["Send enable (true or false), profiles (a list) and reason only."]},
            )
        reason = data.get("reason", "")
        if not isinstance(reason, str) or len(reason) > 255 or "\x00" in reason:
            raise ValidationFailed("reason: at most 255 characters.", fields={"reason": ["A short text."]})
        command = gpu_mig_configure(
            gpu=gpu,
            enable=data["enable"],
            profiles=data.get("profiles", []),
            actor=actor_from_request(request),
            reason=reason,
        )
        gpu.refresh_from_db()
        body = {**gpu_mig_state(gpu), "command": str(command.pk) if command else None}
        # Sent at once (200), or accepted to go when the GPU's work has ended (202).
        return Response(body, status=status.HTTP_200_OK if command else status.HTTP_202_ACCEPTED)


class GpuMigCancelApi(APIView):
    """POST ``{"reason": "..."}``: drop a MIG change that still waits for its GPU to drain."""

    authentication_classes = [StaffTokenAuthentication, BearerTokenAuthentication, SessionAuthentication]
    permission_classes = [StaffPermission]
    staff_scope = StaffScope.FLEET_WRITE

    @extend_schema(operation_id="staff_v1_gpu_mig_cancel", request=ReasonSerializer, responses={200: dict})
    def post(self, request, pk: int):
        gpu = _gpu(pk)
        data = request.data if isinstance(request.data, dict) else None
        if data is None or set(data) - {"reason"}:
            name = str(sorted(set(data) - {"reason"})[0])[:40] if data else "body"
            raise ValidationFailed(f"{name}: only reason.", fields={name: ["Only reason is taken."]})
        reason = data.get("reason", "")
        if not isinstance(reason, str) or len(reason) > 255 or "\x00" in reason:
            raise ValidationFailed("reason: at most 255 characters.", fields={"reason": ["A short text."]})
        gpu_mig_cancel(gpu=gpu, actor=actor_from_request(request), reason=reason.strip())
        gpu.refresh_from_db()
        return Response(gpu_mig_state(gpu))
