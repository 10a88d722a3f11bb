"""The workloads list (filters, search, pagination, live state badges), a workload's page (state and
its stages, why it waits and when it should start, the events timeline, placement and connection
details, the job's log tail, GPU charts from the fleet's telemetry), stop and restart, and the
dashboard panel.

Every page reads a fixed number of queries whatever the number of workloads. Live: the browser's
websocket carries ``workload.state`` events (``scheduling.services.states``); ``static/js/live.js``
updates the badges and ``static/js/workloads.js`` reloads the detail page's live fragment and charts.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

from django import forms
from django.conf import settings
from django.contrib import messages
from django.core import signing
from django.core.paginator import Paginator
from django.db.models import Count, Q, Sum
from django.http import Http404, HttpResponse, JsonResponse, StreamingHttpResponse
from django.shortcuts import redirect
from django.template.defaultfilters import pluralize
from django.urls import reverse
from django.utils import timezone
from django.views.generic import View

from nodes.models import Gpu, Region
from nodes.selectors import node_telemetry
from portal.errors import DomainError
from portal.models import Scope
from portal.views.base import PanelView, TenantScopedMixin, htmx_partial, render_page
from scheduling.models import (
    HOLDING_STATES,
    MILLI,
    TERMINAL_STATES,
    WAITING_STATES,
    Allocation,
    Plan,
    Workload,
    WorkloadKind,
    WorkloadState,
)
from scheduling.selectors.access import (
    SHARE_PARAM,
    TICKET_PARAM,
    TICKET_SALT,
    proxy_url,
    workload_access,
    workload_ports,
)
from scheduling.selectors.arrays import array_spec_of, array_summary, array_tasks, workload_dependencies
from scheduling.selectors.shared import (
    workload_events,
    workload_log_lines,
    workload_placement,
    workload_unconfirmed_stops,
    workload_volumes,
    workloads_for_tenant,
)
from scheduling.selectors.workload_metrics import ceil_minute, workload_held, workload_last_placement
from scheduling.services.access import share_link_create, share_link_revoke
from scheduling.services.elastic import workload_resize
from scheduling.services.lifecycle import workload_stop
from scheduling.services.submission import workload_submit

PAGE_SIZES = (25, 50, 100)
DEFAULT_PAGE_SIZE = 50
LOG_DOWNLOAD_PAGE = 5000
CHART_WINDOW = timedelta(hours=1)
STATE_GROUPS = {
    "active": ("Active (not finished)", set(WAITING_STATES | HOLDING_STATES)),
    "waiting": ("Waiting", set(WAITING_STATES)),
    "holding": ("Placed or running", set(HOLDING_STATES)),
    "finished": ("Finished", set(TERMINAL_STATES)),
}
# A starting workload's stages, in order (the progress shown while it starts).
STAGES = [
    (WorkloadState.PENDING, "Submitted"),
    (WorkloadState.QUEUED, "Queued"),
    (WorkloadState.SCHEDULED, "Placed"),
    (WorkloadState.STARTING, "Starting"),
    (WorkloadState.RUNNING, "Running"),
]


class WorkloadFilterForm(forms.Form):
    q = forms.CharField(label="Search", required=False, max_length=100)
    kind = forms.ChoiceField(
        label="Kind", required=False, choices=[("", "Instances and jobs"), *WorkloadKind.choices]
    )
    state = forms.ChoiceField(
        label="State",
        required=False,
        choices=[
            ("", "Any state"),
            *((key, label) for key, (label, _) in STATE_GROUPS.items()),
            *WorkloadState.choices,
        ],
    )
    plan = forms.ChoiceField(label="Plan", required=False, choices=[("", "Any plan"), *Plan.choices])
    region = forms.ChoiceField(label="Region", required=False)
    per_page = forms.TypedChoiceField(
        label="Per page", required=False, coerce=int, empty_value=DEFAULT_PAGE_SIZE,
        choices=[(n, f"{n} per page") for n in PAGE_SIZES],
    )  # fmt: skip

    def __init__(self, *args, regions: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["region"].choices = [("", "Any region"), *((c, c) for c in regions)]
        for name, f in self.fields.items():
            f.widget.attrs["class"] = "input-sm" if name == "q" else "select-sm"

    def apply(self, qs):
        d = self.cleaned_data
        q = (d.get("q") or "").strip()
        if q:
            ident = q.lstrip("#")
            match = Q(name__icontains=q) | Q(image__icontains=q) | Q(template__icontains=q)
            qs = qs.filter(match | Q(pk=int(ident)) if ident.isdigit() else match)
        if d.get("kind"):
            qs = qs.filter(kind=d["kind"])
        state = d.get("state")
        if state in STATE_GROUPS:
            qs = qs.filter(state__in=STATE_GROUPS[state][1])
        elif state:
            qs = qs.filter(state=state)
        if d.get("plan"):
            qs = qs.filter(plan=d["plan"])
        if d.get("region"):
            qs = qs.filter(region__code=d["region"])
        return qs

    @property
    def active(self) -> bool:
        return (
            self.is_bound
            and self.is_valid()
            and any(self.cleaned_data.get(k) for k in ("q", "kind", "state", "plan", "region"))
        )


class WorkloadsMixin(TenantScopedMixin):
    model = Workload
    read_scope = Scope.READ
    write_scope = Scope.WRITE

    def workload(self, pk: int) -> Workload:
        return self.get_scoped_object(
            Workload.objects.select_related("region", "reservation").prefetch_related("gpu_models"), pk=pk
        )


class WorkloadListView(WorkloadsMixin, View):
    template_name = "scheduling/workloads.html"
    partial_template_name = "scheduling/_workload_rows.html"

    def get(self, request):
        form = WorkloadFilterForm(
            request.GET or None, regions=list(Region.objects.order_by("code").values_list("code", flat=True))
        )
        # The rows show none of the spec's JSON and long text: not read (nor parsed) for 100 rows.
        qs = (
            workloads_for_tenant(tenant=self.tenant)
            .defer("command", "env", "ports", "ssh_public_key", "log_tail", "pending_message")
            .order_by("-id")
        )
        status, per_page = 200, DEFAULT_PAGE_SIZE
        if form.is_bound:
            if form.is_valid():
                qs = form.apply(qs)
                per_page = form.cleaned_data.get("per_page") or DEFAULT_PAGE_SIZE
            else:
                status, qs = 400, qs.none()
        paginator = Paginator(qs, per_page)
        page = paginator.get_page(request.GET.get("page"))
        context = {
            "form": form,
            "page": page,
            "paginator": paginator,
            "workloads": list(page.object_list),
            "filtered": form.active,
            "can_launch": self.has_scope(Scope.WRITE),
            "workloads_url": reverse("scheduling:workloads"),
        }
        return self.render(context, status=status)


# --- a workload's page ------------------------------------------------------------------------------


def stages_of(w: Workload) -> list[dict]:
    """The starting stages with the ones passed marked done and the current one marked."""
    order = [s for s, _ in STAGES]
    if w.state in order:
        current = order.index(w.state)
    elif w.started_at is not None:
        current = len(order)  # it ran: every stage passed
    elif w.scheduled_at is not None:
        current = order.index(WorkloadState.SCHEDULED) + 1
    else:
        current = -1
    return [
        {"state": s, "label": label, "done": i < current or (i == current and s == WorkloadState.RUNNING),
         "current": i == current}
        for i, (s, label) in enumerate(STAGES)
    ]  # fmt: skip


def workload_telemetry(*, workload: Workload, now: datetime | None = None) -> dict | None:
    """Chart data for the GPUs a workload holds now (or held last), from the fleet's per-minute
    rollups and the latest raw samples (``nodes.selectors.node_telemetry``), inside its allocation:
    from its start (the first whole minute) to now or its end, at most the last hour. Nothing from
    before or after it held the GPUs. Four queries. None: it never held a whole GPU (a share's GPU
    also runs other tenants' work, which its charts would show; the API's ``metrics`` gives what
    is attributed to the share)."""
    now = now or timezone.now()
    held = [h for h in workload_held(workload=workload) if not h.shared]
    if not held:
        return None
    held, start, end = workload_last_placement(held, now=now)
    start = max(ceil_minute(start), end - CHART_WINDOW)
    gpus = list(
        Gpu.objects.filter(pk__in=[h.gpu_id for h in held])
        .select_related("node")
        .order_by("node__hostname", "index")
    )
    data = node_telemetry(gpus=gpus, start=start, now=end)
    data["gpus"] = [{"id": g.pk, "label": f"{g.node.hostname} · GPU {g.index}"} for g in gpus]
    data["window_s"] = int(CHART_WINDOW.total_seconds())
    data["holding"] = end == now
    return data


# An array job's page lists its first tasks; the API (GET /api/v1/jobs/{id}/tasks/) pages through all.
ARRAY_TASKS_SHOWN = 200


def detail_context(view: WorkloadsMixin, w: Workload) -> dict:
    can_write = view.has_scope(Scope.WRITE)
    placement = workload_placement(workload=w)
    array = array_summary(workload=w)
    return {
        "w": w,
        "array": array,
        "array_tasks": list(array_tasks(workload=w)[:ARRAY_TASKS_SHOWN]) if array else [],
        "array_tasks_shown": ARRAY_TASKS_SHOWN,
        "depends_on": workload_dependencies(workload=w),
        "events": list(workload_events(workload=w)),
        "placement": placement,
        "access": workload_access(workload=w, placement=placement, request=view.request),
        "unconfirmed_stops": workload_unconfirmed_stops(workload=w),
        "stages": stages_of(w),
        "waiting": w.state in WAITING_STATES,
        "holding": w.state in HOLDING_STATES,
        "can_stop": can_write
        and w.state not in TERMINAL_STATES
        and w.stop_requested_at is None
        and w.state != WorkloadState.STOPPING,
        "can_restart": can_write and w.state in TERMINAL_STATES and w.array_parent_id is None,
        "can_resize": can_write and w.is_elastic and w.state == WorkloadState.RUNNING,
        "can_write": can_write,
        # (name, value, secret name): a secret shows by its name only.
        "env_rows": [
            (k, "", v.get("secret", "")) if isinstance(v, dict) else (k, v, "")
            for k, v in (w.env or {}).items()
        ],
    }


class WorkloadDetailView(WorkloadsMixin, View):
    template_name = "scheduling/workload_detail.html"

    def get(self, request, pk: int):
        w = self.workload(pk)
        retention = settings.WORKLOAD_LOG_RETENTION_DAYS.get(w.tenant.service_plan, 0)
        return self.render(
            {
                **detail_context(self, w),
                "telemetry": workload_telemetry(workload=w),
                "log_retention_days": retention,
                "volumes": workload_volumes(workload=w),  # the specification card, not the live part
            }
        )


class WorkloadLogDownloadView(WorkloadsMixin, View):
    """The whole retained output as text, one line per stored line (``<at> <stream> <text>``),
    read page by page so a long log is never held in memory."""

    def get(self, request, pk: int):
        w = self.workload(pk)

        def lines():
            cursor = 0
            while True:
                rows, cursor = workload_log_lines(workload=w, since=cursor, tail=LOG_DOWNLOAD_PAGE)
                if not rows:
                    return
                yield "".join(f"{at.isoformat()} {stream} {text}\n" for _, at, stream, text in rows)

        response = StreamingHttpResponse(lines(), content_type="text/plain; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="{w.kind}-{w.pk}.log"'
        return response


class WorkloadLiveView(WorkloadsMixin, View):
    """The page's live part (state, stages, actions, placement, log tail, timeline), which
    ``workloads.js`` reloads when a ``workload.state`` event for this workload arrives."""

    def get(self, request, pk: int):
        return render_page(request, "scheduling/_workload_live.html", detail_context(self, self.workload(pk)))


class WorkloadTelemetryView(WorkloadsMixin, View):
    def get(self, request, pk: int):
        return JsonResponse(workload_telemetry(workload=self.workload(pk)) or {"x": [], "gpus": []})


class _ActionView(WorkloadsMixin, View):
    http_method_names = ["post"]

    def respond(self, w: Workload, *, error: str = "", done: str = "", status: int = 200) -> HttpResponse:
        if htmx_partial(self.request):
            context = {**detail_context(self, w), "error": error, "done": done}
            return render_page(self.request, "scheduling/_workload_live.html", context, status=status)
        if error:
            messages.error(self.request, error)
        elif done:
            messages.success(self.request, done)
        return redirect("scheduling:workload", pk=w.pk)


class WorkloadStopView(_ActionView):
    """Stop through ``workload_stop``: a waiting workload stops at once, a placed one is told to."""

    def post(self, request, pk: int):
        w = self.workload(pk)
        try:
            workload_stop(workload=w, actor=self.actor)
        except DomainError as exc:
            return self.respond(self.workload(pk), error=exc.message, status=exc.status_code)
        w = self.workload(pk)
        done = "Stopped." if w.state == WorkloadState.STOPPED else "Stopping: the node was told to stop it."
        return self.respond(w, done=done)


class WorkloadResizeView(_ActionView):
    """Resize a running elastic job through ``workload_resize`` (the API's ``resize`` action): a
    shrink is at once, a growth as GPUs of its node are free."""

    def post(self, request, pk: int):
        w = self.workload(pk)
        raw = request.POST.get("gpu_count", "").strip()
        if not raw.isdigit() or len(raw) > 4:
            return self.respond(w, error="gpu_count: a whole number of GPUs.", status=400)
        before = w.gpu_count
        try:
            workload_resize(workload=w, gpu_count=int(raw), actor=self.actor)
        except DomainError as exc:
            return self.respond(self.workload(pk), error=exc.message, status=exc.status_code)
        w = self.workload(pk)
        n = w.elastic_target_gpus or w.gpu_count
        if w.gpu_count < before:
            done = f"Shrunk to {w.gpu_count} GPU{pluralize(w.gpu_count)}; its node is told."
        elif n > w.gpu_count:
            done = f"Target {n} GPUs: it grows as GPUs of its node are free."
        else:
            done = f"It holds {w.gpu_count} GPU{pluralize(w.gpu_count)}."
        return self.respond(w, done=done)


class WorkloadOpenView(WorkloadsMixin, View):
    """A member opens an instance's HTTP port: on ``PROXY_ORIGIN``, with a signed one-minute ticket
    that the proxy turns into a cookie of that origin (the portal's session never goes there)."""

    def get(self, request, pk: int, port: int):
        w = self.workload(pk)
        if not any(p["port"] == port and p["url"] for p in workload_ports(workload=w, request=request)):
            raise Http404("No such port is open.")
        url = proxy_url(w.pk, port, request=request)
        if settings.PROXY_ORIGIN:
            ticket = signing.dumps({"u": request.user.pk, "w": w.pk}, salt=TICKET_SALT)
            url = f"{url}?{TICKET_PARAM}={ticket}"
        return redirect(url)


class WorkloadShareLinkView(_ActionView):
    """Make (``action=create``) or revoke (``action=revoke``) the share link of an instance's HTTP
    ports; a new link's URLs are shown once, on the page that made them."""

    def post(self, request, pk: int):
        w = self.workload(pk)
        if request.POST.get("action") == "revoke":
            revoked = share_link_revoke(workload=w, actor=self.actor)
            return self.respond(w, done="Share link revoked." if revoked else "There was no share link.")
        ports = [p for p in workload_ports(workload=w, request=request) if p["protocol"] == "http"]
        if not ports:
            return self.respond(w, error="This instance has no HTTP port to share.", status=400)
        secret = share_link_create(workload=w, actor=self.actor)
        urls = [f"{proxy_url(w.pk, p['port'], request=request)}?{SHARE_PARAM}={secret}" for p in ports]
        if not htmx_partial(request):
            messages.success(request, "Share link made (shown once): " + " ".join(urls))
            return redirect("scheduling:workload", pk=w.pk)
        context = {**detail_context(self, w), "done": "Share link made.", "share_urls": urls}
        return render_page(request, "scheduling/_workload_live.html", context)


def spec_of(w: Workload) -> dict:
    """A finished workload's spec, as ``workload_submit`` takes it (the API's names)."""
    spec = {
        "name": w.name,
        "gpu_models": [m.name for m in w.gpu_models.all()],
        "min_gpu_memory_gib": w.min_gpu_memory_gib,
        "min_compute_weight": str(w.min_compute_weight),
        "gpu_vendor": w.gpu_vendor,
        "cuda_capability": w.cuda_capability,
        "rocm_target": w.rocm_target,
        "min_driver": w.min_driver,
        "min_cuda": w.min_cuda,
        "min_rocm": w.min_rocm,
        "gpu_count": w.gpu_count,
        "gang": w.gang,
        "gpu_fraction_milli": w.gpu_fraction_milli,
        "mig_profile": w.mig_profile,
        "cpu_millicores": w.cpu_millicores,
        "ram_mib": w.ram_mib,
        "region": w.region.code if w.region_id else "",
        "other_regions_ok": w.other_regions_ok,
        "plan": w.plan,
        "spot_max_price": None if w.spot_max_price is None else str(w.spot_max_price),
        "reservation": w.reservation_id,
        "priority_class": w.priority_class,
        "image": w.image,
        "template": w.template,
        "command": list(w.command),
        "env": dict(w.env),
        "ports": list(w.ports),
        "ssh_public_key": w.ssh_public_key,
        "max_runtime_s": w.max_runtime_s,
        "estimated_runtime_s": w.estimated_runtime_s,
        "requeue_on_preemption": w.requeue_on_preemption,
        "checkpoint_resume": w.checkpoint_resume,
        "max_retries": w.max_retries,
        # Its volumes again (the restart is refused if one is gone or now in use by another).
        "volumes": [
            {"volume": v["volume"], "mount_path": v["mount_path"], "shared": v["shared"]}
            for v in workload_volumes(workload=w)
        ],
    }
    if w.array_count is not None:  # the same array again (its dependencies have ended: not carried)
        spec["array"] = array_spec_of(workload=w)
    return spec


class WorkloadRestartView(_ActionView):
    """Restart a finished workload: there is no restart service, so this submits a copy of its spec
    through ``workload_submit`` (the same rules and quotas as a new launch) and opens the new one."""

    def post(self, request, pk: int):
        w = self.workload(pk)
        if w.state not in TERMINAL_STATES:
            return self.respond(w, error=f"Only a finished {w.kind} can be restarted; this one is {w.state}.",
                                status=409)  # fmt: skip
        try:
            new = workload_submit(tenant=self.tenant, kind=w.kind, spec=spec_of(w), actor=self.actor)
        except DomainError as exc:
            return self.respond(w, error=exc.message, status=exc.status_code)
        url = reverse("scheduling:workload", kwargs={"pk": new.pk})
        if htmx_partial(request):
            response = HttpResponse(status=204)
            response["HX-Redirect"] = url
            return response
        messages.success(request, f"Restarted as {new.kind} {new.pk}.")
        return redirect(url)


# --- the dashboard panel ----------------------------------------------------------------------------


FAILED_WINDOW = timedelta(days=7)
FAILED_SHOWN = 5


class WorkloadsPanel(PanelView):
    panel_template_name = "scheduling/panels/workloads.html"
    title = "Running and pending workloads"

    def get_context_data(self, **kwargs):
        qs = Workload.objects.for_tenant(self.tenant)
        counts = qs.aggregate(
            running=Count("id", filter=Q(state=WorkloadState.RUNNING)),
            starting=Count("id", filter=Q(state__in=HOLDING_STATES - {WorkloadState.RUNNING})),
            waiting=Count("id", filter=Q(state__in=WAITING_STATES)),
        )
        active = list(
            workloads_for_tenant(tenant=self.tenant)
            .filter(state__in=WAITING_STATES | HOLDING_STATES)
            .order_by("-id")[:8]
        )
        # GPUs held now per model (shares of a GPU add up: 2 halves are 1), one aggregate query
        in_use = [
            {
                "model": row["gpu_model__short_name"] or row["gpu_model__name"],
                "gpus": Decimal(row["milli"]) / MILLI,
            }
            for row in Allocation.objects.for_tenant(self.tenant)
            .active()
            .order_by()
            .values("gpu_model__name", "gpu_model__short_name")
            .annotate(milli=Sum("fraction_milli"))
            .order_by("-milli", "gpu_model__name")
        ]
        # Failed in the last 7 days, newest first; the sixth only says there are more
        failed = list(
            Workload.objects.for_tenant(self.tenant)
            .filter(state=WorkloadState.FAILED, state_changed_at__gte=timezone.now() - FAILED_WINDOW)
            .only("id", "kind", "name", "image", "template", "state", "state_reason", "state_changed_at")
            .order_by("-state_changed_at", "-id")[: FAILED_SHOWN + 1]
        )
        return super().get_context_data(
            counts=counts,
            active=active,
            in_use=in_use,
            failed=failed[:FAILED_SHOWN],
            more_failed=len(failed) > FAILED_SHOWN,
            can_launch=self.has_scope(Scope.WRITE),
            **kwargs,
        )
