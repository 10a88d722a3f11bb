"""Launch: a form over ``workload_submit`` (the same service and rules as ``POST /api/v1/instances/``
and ``/jobs/``), with the GPU models' live availability per region, their prices per plan, and a cost
estimate and warm-pool hint that follow the form (``LaunchSummaryView``, an htmx fragment).

The form checks the shape of the input only; every rule (catalog, fleet, quotas, admission checks)
is the service's, and its errors are shown next to the field they name.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django import forms
from django.db import transaction
from django.shortcuts import redirect
from django.utils import timezone
from django.views.generic import View

from nodes.models import GpuModel, Region
from portal.errors import DomainError
from portal.models import Scope
from portal.views.base import TenantScopedMixin, render_page
from scheduling.models import (
    MILLI,
    Plan,
    Reservation,
    ReservationStatus,
    Volume,
    WarmSlot,
    Workload,
    WorkloadKind,
    WorkloadTemplate,
)
from scheduling.pricing import gpu_price_table, price_key, workload_estimate
from scheduling.selectors.shared import gpu_availability, gpu_catalog, live_volumes, reservations_for_tenant
from scheduling.services.submission import SCHEDULABLE_VENDORS, QuotaExceeded, workload_submit
from scheduling.services.volumes import volume_create

FRACTIONS = [(1000, "Whole GPUs"), (500, "½ GPU"), (250, "¼ GPU"), (125, "⅛ GPU")]
# The service names spec keys; the form's fields are named for people.
FIELD_OF_SPEC_KEY = {
    "gpu_models": "gpu_model",
    "gpu_model": "gpu_model",
    "gpu_vendor": "gpu_model",
    "min_gpu_memory_gib": "gpu_model",
    "gpu_fraction_milli": "fraction",
    "mig_profile": "fraction",
    "gang": "gpu_count",
    "cpu_millicores": "gpu_count",
    "ram_mib": "gpu_count",
    "volumes": "volume",
}
# Quotas counted in GPUs: their error goes next to the count as well as on top of the form.
GPU_QUOTAS = ("max_gpus_total", "max_spot_gpus", "max_gpus_per_request", "max_gpus[")
HOURS_PER_DAY = 24


class LaunchForm(forms.Form):
    kind = forms.ChoiceField(
        label="What to launch",
        choices=WorkloadKind.choices,
        initial=WorkloadKind.INSTANCE,
        widget=forms.RadioSelect,
    )
    name = forms.CharField(label="Name", required=False, max_length=100)
    # Free text under a list of choices: an unknown model is the service's error, as in the API.
    gpu_model = forms.CharField(label="GPU model", max_length=80, widget=forms.RadioSelect)
    gpu_count = forms.IntegerField(label="GPUs", min_value=1, max_value=4096, initial=1)
    fraction = forms.TypedChoiceField(
        label="Share of a GPU", choices=FRACTIONS, coerce=int, initial=MILLI,
        help_text="A share (½, ¼, ⅛) is of one GPU: the count must then be 1.",
    )  # fmt: skip
    region = forms.CharField(label="Region", required=False, max_length=32, widget=forms.Select)
    other_regions_ok = forms.BooleanField(
        label="Or another region when this one is full", required=False, initial=True,
        help_text="Only with a region chosen; the price is then that region's.",
    )  # fmt: skip
    plan = forms.ChoiceField(label="Plan", choices=Plan.choices, initial=Plan.ON_DEMAND)
    reservation = forms.TypedChoiceField(
        label="Reservation", required=False, coerce=int, empty_value=None,
        help_text="The reserved plan draws from one of your active reservations.",
    )  # fmt: skip
    spot_max_price = forms.DecimalField(
        label="Highest spot price per GPU-hour", required=False, min_value=0, max_digits=22, decimal_places=10,
        help_text="Spot only: preempted when the market price rises above it.",
    )  # fmt: skip
    image = forms.CharField(
        label="Image", required=False, max_length=255, help_text="e.g. nvcr.io/nvidia/pytorch:24.08-py3"
    )
    template = forms.CharField(
        label="Template", required=False, max_length=100, widget=forms.Select,
        help_text="Fills the image, command, ports, env, minimum GPU memory and volume path you leave empty.",
    )  # fmt: skip
    env = forms.CharField(
        label="Environment variables", required=False, strip=False,
        widget=forms.Textarea(attrs={"rows": 3, "placeholder": "MODE=train\nBATCH=64"}),
        help_text="One NAME=value a line; values are kept exactly as written.",
    )  # fmt: skip
    secret_env = forms.CharField(
        label="Secrets as variables", required=False,
        widget=forms.Textarea(attrs={"rows": 2, "placeholder": "HF_TOKEN=hf-token"}),
        help_text="One NAME=SECRET a line: the variable gets the secret's value when the workload starts.",
    )  # fmt: skip
    ssh_public_key = forms.CharField(
        label="SSH public key", required=False, max_length=16_000,
        widget=forms.Textarea(attrs={"rows": 2, "placeholder": "ssh-ed25519 AAAA… you@laptop"}),
        help_text="Instances only: a key that may log in besides your team's saved SSH keys "
        "(ed25519, ECDSA, or RSA of 2048 bits or more).",
    )  # fmt: skip
    command = forms.CharField(
        label="Command", required=False, max_length=4000,
        help_text="Run as given, split like a shell would (no shell features). "
        "An instance may leave it empty to run its image's default.",
    )  # fmt: skip

    volume = forms.TypedChoiceField(
        label="Volume", required=False, coerce=int, empty_value=None,
        help_text="One of your volumes; the workload then runs in its region. Kept when it ends.",
    )  # fmt: skip
    mount_path = forms.CharField(
        label="Mounted at", required=False, max_length=255, initial="/workspace",
        help_text="Left empty with a template: where the template mounts its volume.",
    )  # fmt: skip
    new_volume_name = forms.CharField(
        label="Or a new volume", required=False, max_length=63,
        help_text="Its name: made in the chosen region when you launch, kept when the workload ends.",
    )  # fmt: skip
    new_volume_size_gib = forms.IntegerField(
        label="New volume size (GiB)", required=False, min_value=1, max_value=1_000_000, initial=10
    )
    volume_shared = forms.BooleanField(
        label="Share the volume", required=False,
        help_text="Others that share it may use it at the same time.",
    )  # fmt: skip
    checkpoint_resume = forms.BooleanField(
        label="Checkpoint and resume", required=False,
        help_text="Jobs: $GPUPOOL_CHECKPOINT_DIR on the volume; after a preemption it resumes with GPUPOOL_RESUME=1.",
    )  # fmt: skip

    def __init__(
        self,
        *args,
        models: list[GpuModel],
        regions: list[str],
        reservations: list[Reservation],
        templates: list[str] = (),
        volumes: list[Volume] = (),
        **kw,
    ):
        super().__init__(*args, **kw)
        self.fields["template"].widget.choices = [("", "None"), *((t, t) for t in templates)]
        self.fields["template"].widget.attrs.pop("maxlength", None)
        self.fields["volume"].choices = [("", "None")] + [
            (v.pk, f"{v.name} ({v.size_gib} GiB in {v.region.code})") for v in volumes
        ]
        self.fields["gpu_model"].widget.choices = [(m.name, m.name) for m in models]
        if models and not self.is_bound:
            self.fields["gpu_model"].initial = models[0].name
        self.fields["region"].widget.choices = [("", "Any region"), *((c, c) for c in regions)]
        self.fields["region"].widget.attrs.pop("maxlength", None)  # a select has no length
        self.fields["reservation"].choices = [("", "None")] + [
            (r.pk, f"#{r.pk}: {r.count} x {r.gpu_model.name} in {r.region.code}, until {r.ends_at:%Y-%m-%d}")
            for r in reservations
        ]

    def clean_command(self) -> list[str]:
        text = self.cleaned_data.get("command") or ""
        try:
            return shlex.split(text)
        except ValueError as exc:
            raise forms.ValidationError(f"Cannot split this command: {exc}.") from None

    @staticmethod
    def _lines(text: str) -> list[tuple[str, str]]:
        pairs = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            name, sep, value = line.partition("=")
            if not sep or not name.strip():
                raise forms.ValidationError(f"Line {number}: write NAME=value.")
            pairs.append((name.strip(), value))
        return pairs

    def clean_env(self) -> dict[str, str]:
        return dict(self._lines(self.cleaned_data.get("env") or ""))

    def clean_secret_env(self) -> dict[str, dict[str, str]]:
        return {k: {"secret": v.strip()} for k, v in self._lines(self.cleaned_data.get("secret_env") or "")}

    def spec(self) -> dict[str, Any]:
        """The service's spec: what was filled in, under the API's names."""
        d = self.cleaned_data
        spec: dict[str, Any] = {
            "name": d["name"],
            "gpu_models": [d["gpu_model"]],
            "gpu_count": d["gpu_count"],
            "plan": d["plan"],
            "image": d["image"],
        }
        if d["fraction"] != MILLI:
            spec["gpu_fraction_milli"] = d["fraction"]
        for key in ("region", "template", "ssh_public_key"):
            if d[key]:
                spec[key] = d[key]
        if d["region"]:
            spec["other_regions_ok"] = d["other_regions_ok"]
        if d["command"]:
            spec["command"] = d["command"]
        if d["env"] or d["secret_env"]:
            spec["env"] = {**d["env"], **d["secret_env"]}
        if d["reservation"] is not None:
            spec["reservation"] = d["reservation"]
        if d["spot_max_price"] is not None:
            spec["spot_max_price"] = str(d["spot_max_price"])
        if d["volume"] is not None:
            spec["volumes"] = [self.volume_item(d["volume"])]
        if d["checkpoint_resume"]:
            spec["checkpoint_resume"] = True
        return spec

    def volume_item(self, volume_id: int) -> dict[str, Any]:
        """The spec's volume: with a template and no path, the template's path fills it."""
        d = self.cleaned_data
        item: dict[str, Any] = {"volume": volume_id, "shared": d["volume_shared"]}
        path = d["mount_path"] or ("" if d["template"] else "/workspace")
        if path:
            item["mount_path"] = path
        return item

    def clean(self):
        d = super().clean()
        if d.get("new_volume_name") and d.get("volume") is not None:
            self.add_error("new_volume_name", "Choose a volume or name a new one, not both.")
        if d.get("new_volume_name") and not d.get("region"):
            self.add_error("region", "A new volume is made in one region: choose it.")
        if d.get("new_volume_name") and d.get("new_volume_size_gib") is None:
            self.add_error("new_volume_size_gib", "The new volume's size.")
        return d

    def show_volume_error(self, exc: DomainError) -> None:
        """``volume_create``'s error, next to the new volume's fields."""
        self.add_error(None, exc.message)
        names = {"name": "new_volume_name", "size_gib": "new_volume_size_gib", "region": "region"}
        for key, messages in (exc.fields or {}).items():
            name = names.get(key)
            if name and name not in self.errors:
                for message in messages if isinstance(messages, list | tuple) else [messages]:
                    self.add_error(name, str(message))

    def show_error(self, exc: DomainError) -> None:
        """The service's error next to the field it names (a quota's next to the count too)."""
        self.add_error(None, exc.message)
        if isinstance(exc, QuotaExceeded):
            quota = str(exc.fields.get("quota", ""))
            if quota.startswith(GPU_QUOTAS):
                self.add_error("gpu_count", exc.message)
            return
        for key, messages in (exc.fields or {}).items():
            name = FIELD_OF_SPEC_KEY.get(key, key)
            if name in self.fields and name not in self.errors:
                for message in messages if isinstance(messages, list | tuple) else [messages]:
                    self.add_error(name, str(message))


# --- the GPU list and the summary ------------------------------------------------------------------


@dataclass
class ModelOffer:
    """One GPU model as the launch page shows it: where it is free and what it costs per plan."""

    model: GpuModel
    regions: list[dict[str, Any]] = field(default_factory=list)  # code, free, schedulable, total, prices
    free_gpus: int = 0
    schedulable_gpus: int = 0
    total_gpus: int = 0
    lowest: dict[str, Decimal | None] = field(default_factory=dict)  # per plan, across regions


def model_offers(*, region_objects: dict[str, Region]) -> list[ModelOffer]:
    """The catalog models present in the fleet, with availability per region (``gpu_availability``,
    one statement) and the hourly price of one GPU per plan and region (the price providers)."""
    availability = gpu_availability()
    offers = []
    catalog = [
        m
        for m in gpu_catalog().filter(pk__in=list(availability)).order_by("vendor", "-memory_gib", "name")
        if m.vendor in SCHEDULABLE_VENDORS
    ]
    table = gpu_price_table(
        pairs=[(m, region_objects.get(code)) for m in catalog for code in availability[m.pk]]
    )
    for m in catalog:
        offer = ModelOffer(model=m)
        for code in sorted(availability[m.pk]):
            ra = availability[m.pk][code]
            prices = table[price_key(m, region_objects.get(code))]
            offer.regions.append(
                {"code": code, "free": ra.free_gpus, "schedulable": ra.schedulable_gpus, "total": ra.total_gpus,
                 "free_milli": ra.free_milli, "prices": prices}
            )  # fmt: skip
            offer.free_gpus += ra.free_gpus
            offer.schedulable_gpus += ra.schedulable_gpus
            offer.total_gpus += ra.total_gpus
            for plan, price in prices.items():
                if price is not None and (offer.lowest.get(plan) is None or price < offer.lowest[plan]):
                    offer.lowest[plan] = price
                offer.lowest.setdefault(plan, None)
        offers.append(offer)
    return offers


@dataclass
class Estimate:
    gpus: Decimal
    plan: str
    plan_label: str
    per_gpu_hour: Decimal | None
    per_hour: Decimal | None
    per_day: Decimal | None
    dearest_region: bool  # no region chosen: the dearest region that has the model
    warm: bool  # a warm-pool GPU is ready for it: starts in seconds
    offer: ModelOffer | None


def _warm_hit(*, model: GpuModel, region: str, image: str, template: str, count: int) -> bool:
    """Whether free warm slots of a matching pool can take the request whole (as the cycle binds
    them: the pool's model, its region or none chosen, its image or template)."""
    if not (image or template):
        return False
    slots = WarmSlot.objects.filter(ended_at__isnull=True, pool__enabled=True, pool__gpu_model=model)
    if region:
        slots = slots.filter(pool__region__code=region)
    match = slots.none()
    if image:
        match = match | slots.filter(pool__image=image)
    if template:
        match = match | slots.filter(pool__template=template)
    return match.count() >= count


def estimate_for(
    data: dict[str, Any], offers: list[ModelOffer], *, tenant, region_objects: dict[str, Region]
) -> Estimate | None:
    """Price of an hour and a day of what the form describes, at the chosen region's price (or the
    dearest region's when none is chosen: the scheduler may place it in any): the price providers'
    ``workload_estimate``, the same figure as ``/api/v1/cost-estimate/``."""
    by_name = {o.model.name: o for o in offers}
    offer = by_name.get(str(data.get("gpu_model") or "")) or (offers[0] if offers else None)
    if offer is None:
        return None
    try:
        count = max(1, min(int(data.get("gpu_count") or 1), 4096))
        fraction = int(data.get("fraction") or MILLI)
    except (TypeError, ValueError):
        count, fraction = 1, MILLI
    if fraction not in dict(FRACTIONS):
        fraction = MILLI
    plan = data.get("plan") if data.get("plan") in Plan.values else Plan.ON_DEMAND
    region = str(data.get("region") or "")
    gpus = Decimal(count * fraction) / MILLI
    rows = [r for r in offer.regions if not region or r["code"] == region]
    per_hour = (
        workload_estimate(
            tenant=tenant,
            gpu_model=offer.model,
            regions=[region_objects[r["code"]] for r in rows if r["code"] in region_objects],
            gpu_count=count,
            fraction_milli=fraction,
        )[plan]
        if rows
        else None
    )
    return Estimate(
        gpus=gpus,
        plan=plan,
        plan_label=Plan(plan).label,
        per_gpu_hour=None if per_hour is None else per_hour / gpus,
        per_hour=per_hour,
        per_day=None if per_hour is None else per_hour * HOURS_PER_DAY,
        dearest_region=not region and len(rows) > 1,
        warm=_warm_hit(
            model=offer.model,
            region=region,
            image=str(data.get("image") or "").strip(),
            template=str(data.get("template") or "").strip(),
            count=count if fraction == MILLI else 1,
        ),
        offer=offer,
    )


class LaunchMixin(TenantScopedMixin):
    """Reading the page needs the read scope; launching (POST) the write scope."""

    template_name = "scheduling/launch.html"
    model = Workload
    read_scope = Scope.READ
    write_scope = Scope.WRITE

    def chosen_template(self, name: str) -> WorkloadTemplate | None:
        """The template a launch names (the tenant's own before the catalog's), for its card."""
        if not name:
            return None
        found = {
            t.is_catalog: t for t in WorkloadTemplate.objects.available_to(self.tenant).filter(name=name)
        }
        return found.get(False) or found.get(True)

    def page_context(self, *, form: LaunchForm | None = None, data=None, initial=None) -> dict[str, Any]:
        region_objects = {r.code: r for r in Region.objects.order_by("code")}
        offers = model_offers(region_objects=region_objects)
        reservations = list(
            reservations_for_tenant(tenant=self.tenant).filter(
                status=ReservationStatus.ACTIVE, ends_at__gt=timezone.now()
            )
        )
        if form is None:
            form = LaunchForm(
                data,
                models=[o.model for o in offers],
                regions=list(region_objects),
                reservations=reservations,
                templates=list(
                    WorkloadTemplate.objects.available_to(self.tenant)
                    .values_list("name", flat=True)
                    .distinct()
                ),
                volumes=list(live_volumes(tenant=self.tenant)),
                initial=initial,
            )
        values = (
            form.data
            if form.is_bound
            else {name: form.initial.get(name, f.initial) for name, f in form.fields.items()}
        )
        chosen = self.chosen_template(str(values.get("template") or ""))
        return {
            "form": form,
            "offers": offers,
            "estimate": estimate_for(values, offers, tenant=self.tenant, region_objects=region_objects),
            "currency": self.tenant.currency,
            "can_launch": self.has_scope(Scope.WRITE),
            "plans": Plan.choices,
            "reservations": reservations,
            "chosen_template": chosen,
        }


class _VolumeRefused(Exception):
    def __init__(self, error: DomainError) -> None:
        self.error = error


class LaunchView(LaunchMixin, View):
    def get(self, request):
        # ``?template=NAME`` (the templates page's "Launch"): the form starts from that template.
        initial = None
        chosen = self.chosen_template(str(request.GET.get("template") or "")[:100])
        if chosen is not None:
            initial = {"template": chosen.name, "mount_path": chosen.volume_mount_path or "/workspace"}
        return self.render(self.page_context(initial=initial))

    def post(self, request):
        context = self.page_context(data=request.POST)
        form: LaunchForm = context["form"]
        if not form.is_valid():
            return self.render(context, status=400)
        kind = form.cleaned_data["kind"]
        try:
            # One user action: a new volume is kept only when the workload is accepted with it.
            with transaction.atomic():
                spec = form.spec()
                if form.cleaned_data["new_volume_name"]:
                    spec["volumes"] = [self.new_volume(form)]
                workload = workload_submit(tenant=self.tenant, kind=kind, spec=spec, actor=self.actor)
        except _VolumeRefused as refused:
            form.show_volume_error(refused.error)
            return self.render(context, status=refused.error.status_code)
        except DomainError as exc:
            form.show_error(exc)
            return self.render(context, status=exc.status_code)
        return redirect("scheduling:workload", pk=workload.pk)

    def new_volume(self, form: LaunchForm) -> dict[str, Any]:
        d = form.cleaned_data
        try:
            volume = volume_create(
                tenant=self.tenant,
                name=d["new_volume_name"],
                region=d["region"],
                size_gib=d["new_volume_size_gib"],
                actor=self.actor,
            )
        except DomainError as exc:
            raise _VolumeRefused(exc) from None
        return form.volume_item(volume.pk)


class LaunchSummaryView(LaunchMixin, View):
    """The estimate card: what the form describes costs this much, and may start in seconds."""

    def get(self, request):
        context = self.page_context(data=request.GET)
        return render_page(request, "scheduling/_launch_summary.html", context)
