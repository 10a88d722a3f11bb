"""The tenant's volumes page: each volume with its region, size, use as an agent last measured it
and the workloads using it; a form to create one, and delete (refused while one is in use).

Reading needs the read scope, creating and deleting the write scope. Two queries whatever the
number of volumes: the volumes (with their regions) and who uses them.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings
from django.contrib import messages
from django.shortcuts import redirect
from django.views.generic import View

from nodes.models import Region
from portal.errors import DomainError
from portal.models import Scope
from portal.views.base import TenantScopedMixin
from scheduling.models import Volume
from scheduling.selectors.shared import live_volumes
from scheduling.services.volumes import storage_root, volume_create, volume_delete, volume_in_use_by

GIB = 1024**3


class VolumeForm(forms.Form):
    name = forms.CharField(label="Name", max_length=63, help_text="Lowercase letters, digits and . _ -")
    region = forms.ChoiceField(label="Region")
    size_gib = forms.IntegerField(label="Size (GiB)", min_value=1, initial=50)

    def __init__(self, *args, regions: list[str], **kw):
        super().__init__(*args, **kw)
        self.fields["region"].choices = [(code, code) for code in regions]
        self.fields["size_gib"].max_value = settings.VOLUME_MAX_SIZE_GIB


class VolumesView(TenantScopedMixin, View):
    template_name = "scheduling/volumes.html"
    model = Volume
    read_scope = Scope.READ
    write_scope = Scope.WRITE

    def context(self, form: VolumeForm | None = None) -> dict[str, Any]:
        regions = [r.code for r in Region.objects.order_by("code") if storage_root(r)]
        volumes = list(live_volumes(tenant=self.tenant))
        users = volume_in_use_by(volume_ids=[v.pk for v in volumes])
        rows = [
            {
                "volume": v,
                "used_gib": None if v.used_bytes is None else v.used_bytes / GIB,
                "used_pct": None if v.used_bytes is None else min(100, 100 * v.used_bytes / v.size_bytes),
                "over": v.used_bytes is not None and v.used_bytes > v.size_bytes,
                "users": sorted(wid for wid, _ in users.get(v.pk, [])),
            }
            for v in volumes
        ]
        return {
            "rows": rows,
            "form": form or VolumeForm(regions=regions),
            "can_write": self.has_scope(Scope.WRITE),
        }

    def get(self, request):
        return self.render(self.context())

    def post(self, request):
        regions = [r.code for r in Region.objects.order_by("code") if storage_root(r)]
        form = VolumeForm(request.POST, regions=regions)
        if not form.is_valid():
            return self.render(self.context(form), status=400)
        try:
            volume = volume_create(tenant=self.tenant, actor=self.actor, **form.cleaned_data)
        except DomainError as exc:
            form.add_error(None, exc.message)
            for key, errors in (exc.fields or {}).items():
                if key in form.fields:
                    form.add_error(key, " ".join(map(str, errors)))
            return self.render(self.context(form), status=exc.status_code)
        messages.success(request, f"Volume {volume.name} created in {volume.region.code}.")
        return redirect("scheduling:volumes")


class VolumeDeleteView(TenantScopedMixin, View):
    model = Volume
    write_scope = Scope.WRITE

    def post(self, request, pk: int):
        volume = self.get_scoped_object(live_volumes(tenant=self.tenant), pk=pk)
        try:
            volume_delete(volume=volume, actor=self.actor)
        except DomainError as exc:
            messages.error(request, exc.message)
        else:
            messages.success(request, f"Volume {volume.name} deleted; its data is being removed.")
        return redirect("scheduling:volumes")
