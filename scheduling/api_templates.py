"""``/api/v1/templates/``: the catalog's templates and the tenant's own; the tenant's own can be
created, changed and deleted here (the catalog's by staff, in the admin). Imported by
``scheduling.api`` so that its viewset is on the shared router."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, mixins, serializers, status
from rest_framework.response import Response

from portal.api.routers import router
from portal.api.serializers import FieldsOnceModelSerializer
from portal.api.viewsets import TenantReadOnlyViewSet
from scheduling.api_fields import EnvValueField
from scheduling.models import WorkloadTemplate
from scheduling.services.templates import EDITABLE, template_create, template_delete, template_update


class TemplateSerializer(FieldsOnceModelSerializer):
    catalog = serializers.BooleanField(source="is_catalog", read_only=True)

    class Meta:
        model = WorkloadTemplate
        fields = [
            "id",
            "catalog",
            *EDITABLE,
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields


class TemplateWriteSerializer(serializers.Serializer):
    """Shape and types only; the service applies the workload rules to each field."""

    name = serializers.CharField(max_length=100)
    description = serializers.CharField(required=False, allow_blank=True, max_length=2000)
    image = serializers.CharField(max_length=255)
    command = serializers.ListField(
        child=serializers.CharField(allow_blank=True, trim_whitespace=False), required=False
    )
    ports = serializers.ListField(child=serializers.IntegerField(), required=False, max_length=64)
    env = serializers.DictField(child=EnvValueField(), required=False)
    min_gpu_memory_gib = serializers.IntegerField(required=False, min_value=0, max_value=4096)
    volume_mount_path = serializers.CharField(required=False, allow_blank=True, max_length=255)
    volume_required = serializers.BooleanField(required=False)


class TemplateViewSet(TenantReadOnlyViewSet, mixins.CreateModelMixin, mixins.DestroyModelMixin):
    """Templates to launch from (``"template": NAME`` in a launch): ``catalog`` ones, which gpupool
    staff manage, and your own, which you create, PATCH and DELETE here. ``volume_mount_path`` is
    where a launch's first volume is mounted when it names no path; with ``volume_required`` a
    launch from the template must name a volume."""

    queryset = WorkloadTemplate.objects.all()
    serializer_class = TemplateSerializer
    filterset_fields = ["name"]
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def get_queryset(self):
        return WorkloadTemplate.objects.available_to(self.ctx.tenant)

    def get_serializer_class(self):
        return TemplateWriteSerializer if self.action in ("create", "partial_update") else TemplateSerializer

    def own_object(self) -> WorkloadTemplate:
        template = self.get_object()
        if template.is_catalog:
            raise exceptions.PermissionDenied("Catalog templates are managed by gpupool staff.")
        return template

    @extend_schema(responses={201: TemplateSerializer})
    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        template = template_create(
            tenant=self.ctx.tenant, data=dict(serializer.validated_data), actor=self.actor
        )
        return Response(TemplateSerializer(template).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=TemplateWriteSerializer, responses=TemplateSerializer)
    def partial_update(self, request, *args, **kwargs):
        template = self.own_object()
        serializer = self.get_serializer(data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        template = template_update(template=template, data=dict(serializer.validated_data), actor=self.actor)
        return Response(TemplateSerializer(template).data)

    def destroy(self, request, *args, **kwargs):
        template_delete(template=self.own_object(), actor=self.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)


router.register("templates", TemplateViewSet, basename="template")
