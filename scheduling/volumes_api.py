"""``/api/v1/volumes/``: a tenant's persistent volumes (list, create, retrieve, resize, delete).

Registered on portal's shared router when ``scheduling.api`` is imported. The rules live in
``scheduling.services.volumes``.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.response import Response

from portal.api.routers import router
from portal.api.viewsets import TenantReadOnlyViewSet
from portal.errors import ValidationFailed
from scheduling.models import Volume, VolumeState
from scheduling.services.volumes import volume_create, volume_delete, volume_in_use_by, volume_resize


class VolumeSerializer(serializers.ModelSerializer):
    region = serializers.SlugRelatedField(read_only=True, slug_field="code")
    in_use_by = serializers.SerializerMethodField(help_text="Ids of the live workloads it is attached to.")

    class Meta:
        model = Volume
        fields = [
            "id",
            "name",
            "region",
            "size_gib",
            "used_bytes",
            "used_measured_at",
            "state",
            "created_at",
            "in_use_by",
        ]
        read_only_fields = fields

    def get_in_use_by(self, v: Volume) -> list[int]:
        users = self.context.get("in_use")
        if users is None:
            users = volume_in_use_by(volume_ids=[v.pk])
        return sorted(wid for wid, _ in users.get(v.pk, []))


class VolumeCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=63)
    region = serializers.CharField(max_length=32)
    size_gib = serializers.IntegerField()


class VolumeResizeSerializer(serializers.Serializer):
    size_gib = serializers.IntegerField(
        help_text="The new size: larger at any time; smaller only above what it holds (409 otherwise)."
    )


class VolumeViewSet(TenantReadOnlyViewSet, mixins.CreateModelMixin, mixins.DestroyModelMixin):
    """Persistent storage in a region, attached to workloads at submission (``volumes``); kept
    when they end. PATCH ``{"size_gib": N}`` resizes it (billing follows the size over time).
    DELETE refuses (409) while a live workload uses it and removes its data."""

    queryset = Volume.objects.exclude(state=VolumeState.DELETED).select_related("region")
    serializer_class = VolumeSerializer
    filterset_fields = ["region__code"]

    def get_serializer_class(self):
        if self.action == "create":
            return VolumeCreateSerializer
        return VolumeResizeSerializer if self.action == "partial_update" else VolumeSerializer

    def paginate_queryset(self, queryset):
        page = super().paginate_queryset(queryset)
        if page is not None:  # every volume's users in one query
            self.in_use = volume_in_use_by(volume_ids=[v.pk for v in page])
        return page

    def get_serializer_context(self):
        context = super().get_serializer_context()
        if hasattr(self, "in_use"):
            context["in_use"] = self.in_use
        return context

    @extend_schema(responses={201: VolumeSerializer})
    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        volume = volume_create(tenant=self.ctx.tenant, actor=self.actor, **serializer.validated_data)
        volume = self.get_queryset().get(pk=volume.pk)
        return Response(VolumeSerializer(volume).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=VolumeResizeSerializer, responses={200: VolumeSerializer})
    def partial_update(self, request, *args, **kwargs):
        volume = self.get_object()  # another tenant's: 404 whatever the body says
        serializer = VolumeResizeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        unknown = sorted(set(request.data) - {"size_gib"}) if hasattr(request.data, "keys") else []
        if unknown:
            raise ValidationFailed(
                f"{unknown[0]}: only size_gib can be changed.", fields={unknown[0]: ["Cannot be changed."]}
            )
        volume_resize(volume=volume, size_gib=serializer.validated_data["size_gib"], actor=self.actor)
        return Response(VolumeSerializer(self.get_queryset().get(pk=volume.pk)).data)

    def destroy(self, request, *args, **kwargs):
        volume_delete(volume=self.get_object(), actor=self.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)


router.register("volumes", VolumeViewSet, basename="volume")
