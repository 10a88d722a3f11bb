"""A node: facts, GPUs, live telemetry charts, command history, and the staff actions (cordon,
drain, uncordon, maintenance; return a GPU to service; set a GPU's MIG mode and layout; make a re-key
token), each through the nodes services (audited)."""

from __future__ import annotations

from datetime import timedelta

from django import forms
from django.contrib import messages
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.views.generic import View

from nodes import selectors
from nodes.mig_profiles import table_for
from nodes.models import Gpu, GpuHealth, Node, NodeState
from nodes.services import health as health_services
from nodes.services import registration
from nodes.services.mig import gpu_mig_cancel, gpu_mig_configure, gpu_mig_waiting_for
from nodes.views.base import StaffRequiredMixin
from portal.errors import DomainError
from portal.views.base import htmx_partial, render_page

RANGES = {"1h": timedelta(hours=1), "6h": timedelta(hours=6), "24h": timedelta(hours=24)}

# action -> (service, the state it leads to, past tense for messages)
ACTIONS = {
    "cordon": (health_services.node_cordon, NodeState.CORDONED, "cordoned"),
    "drain": (health_services.node_drain, NodeState.DRAINING, "set to drain"),
    "uncordon": (health_services.node_uncordon, NodeState.READY, "returned to service"),
    "maintenance": (health_services.node_set_maintenance, NodeState.MAINTENANCE, "put into maintenance"),
}


def actions_for(state: str) -> list[str]:
    """The actions the services accept from ``state`` (their transition table), in display order."""
    allowed = health_services._STAFF_TRANSITIONS
    return [name for name, (_, target, _) in ACTIONS.items() if target != state and state in allowed[target]]


class ReasonForm(forms.Form):
    reason = forms.CharField(label="Reason", required=False, max_length=255, strip=True)


def _node(pk: int) -> Node:
    return get_object_or_404(Node.objects.select_related("region"), pk=pk)


def _state_context(
    node: Node, *, form: ReasonForm | None = None, error: str = "", done: str = "", gpu_errors=None
) -> dict:
    return {
        "node": node,
        "actions": actions_for(node.state),
        "form": form or ReasonForm(),
        "error": error,
        "done": done,
        "gpu_errors": gpu_errors or {},
    }


def _page_context(request, node: Node, **state) -> dict:
    gpus = selectors.node_gpus(node=node)
    range_key = request.GET.get("range", "1h")
    if range_key not in RANGES:
        range_key = "1h"
    now = timezone.now()
    telemetry = selectors.node_telemetry(gpus=gpus, start=now - RANGES[range_key], now=now)
    stale = selectors.telemetry_stale_before(now)
    gpu_errors = state.get("gpu_errors") or {}
    mig_errors = state.pop("mig_errors", None) or {}
    for g in gpus:
        g.fresh = g.last_sample_at is not None and g.last_sample_at >= stale
        g.form = gpu_errors.get(g.pk)
        _mig_context(g, mig_errors.get(g.pk))
    return {
        **_state_context(node, **state),
        "gpus": gpus,
        "telemetry": {**telemetry, "window_s": int(RANGES[range_key].total_seconds())},
        "range_key": range_key,
        "ranges": list(RANGES),
        "commands": list(selectors.node_commands_history(node=node, limit=20)),
        "history": list(selectors.node_state_history(node=node)),
    }


def _layout_text(layout) -> str:
    return ", ".join(f"{row['profile']}@{row['start']}" for row in layout or [])


def _mig_context(gpu: Gpu, form: MigForm | None = None) -> None:
    """What the GPU row shows of MIG: the profiles its model offers, its layout, a change pending
    (what, since when, by whom, waiting for which workloads), the form."""
    table = table_for(gpu.model.name if gpu.model_id else gpu.reported_name)
    gpu.mig_profiles = list(table.names) if table is not None else []
    gpu.mig_layout_text = _layout_text(gpu.mig_layout)
    gpu.mig_form = form
    pending = gpu.mig_pending
    gpu.mig_draining = pending is not None and gpu.mig_sent_at is None
    gpu.mig_pending_text = ""
    gpu.mig_waiting = []
    if pending is not None:
        layout = _layout_text(pending.get("layout"))
        gpu.mig_pending_text = (
            ("MIG on, layout " + layout if layout else "MIG on, an instance per workload")
            if pending.get("enable")
            else "MIG off"
        )
        gpu.mig_requested_by = pending.get("requested_by", "")
        gpu.mig_waiting = gpu_mig_waiting_for(gpu=gpu)


class MigForm(forms.Form):
    enable = forms.BooleanField(label="MIG mode on", required=False)
    profiles = forms.CharField(label="Layout", required=False, max_length=200, strip=True)
    reason = forms.CharField(label="Reason", required=False, max_length=255, strip=True)

    def clean_profiles(self) -> list[str]:
        text = self.cleaned_data["profiles"]
        return [p.strip() for p in text.replace(",", " ").split() if p.strip()]


TEMPLATE = "nodes/node_detail.html"


class NodeDetailView(StaffRequiredMixin, View):
    def get(self, request, pk: int):
        return render_page(request, TEMPLATE, _page_context(request, _node(pk)))


class NodeActionView(StaffRequiredMixin, View):
    """POST ``reason``: the action's service is called in one transaction; a refusal (a state the
    action does not apply to, a missing reason) answers 400/409 with the message in the actions card
    and changes nothing."""

    http_method_names = ["post"]

    def post(self, request, pk: int, action: str):
        if action not in ACTIONS:
            raise Http404("No such action.")
        node = _node(pk)
        service, _, past = ACTIONS[action]
        form = ReasonForm(request.POST)
        if not form.is_valid():
            return self._respond(node, form=form, status=400)
        try:
            node = service(node=node, actor=self.actor, reason=form.cleaned_data["reason"])
        except DomainError as exc:
            node = _node(pk)
            if "reason" in exc.fields:
                form.add_error("reason", exc.message)
                return self._respond(node, form=form, status=exc.status_code)
            return self._respond(node, form=form, error=exc.message, status=exc.status_code)
        message = f"{node.hostname} was {past}."
        if htmx_partial(request):
            return self._respond(node, status=200, done=message)
        messages.success(request, message)
        return redirect("nodes:node", pk=node.pk)

    def _respond(self, node: Node, *, status: int, **state):
        if htmx_partial(self.request):
            context = _state_context(node, **state)
            template = "nodes/_node_state.html"
        else:  # without JavaScript: the whole page, the error in its actions card
            context = _page_context(self.request, node, **state)
            template = TEMPLATE
        return render_page(self.request, template, context, status=status)


class NodeRekeyView(StaffRequiredMixin, View):
    """POST: a re-key token for the node (audited), shown once in the answer and never stored; the
    answer is not cached."""

    http_method_names = ["post"]

    def post(self, request, pk: int):
        node = _node(pk)
        token, plaintext = registration.node_rekey_token_create(node=node, actor=self.actor)
        context = {"node": node, "rekey_token": token, "rekey_plaintext": plaintext}
        if htmx_partial(request):
            response = render_page(request, "nodes/_node_rekey.html", context, status=201)
        else:
            response = render_page(request, TEMPLATE, {**_page_context(request, node), **context}, status=201)
        add_never_cache_headers(response)
        return response


class GpuReturnView(StaffRequiredMixin, View):
    """POST ``reason``: an unhealthy or isolated GPU is healthy and schedulable again (audited)."""

    http_method_names = ["post"]

    def post(self, request, pk: int):
        gpu = get_object_or_404(Gpu.objects.select_related("node", "model"), pk=pk, removed_at__isnull=True)
        form = ReasonForm(request.POST)
        if not form.is_valid():
            return self._respond(gpu, form=form, status=400)
        if gpu.health == GpuHealth.HEALTHY and not gpu.isolated:
            form.add_error("reason", f"GPU {gpu.index} is already in service.")
            return self._respond(gpu, form=form, status=409)
        gpu = health_services.gpu_return_to_service(
            gpu=gpu, actor=self.actor, reason=form.cleaned_data["reason"]
        )
        message = f"GPU {gpu.index} of {gpu.node.hostname} is back in service."
        if htmx_partial(request):
            gpu = Gpu.objects.select_related("node", "model").get(pk=gpu.pk)
            return self._respond(gpu, form=None, status=200, done=message)
        messages.success(request, message)
        return redirect("nodes:node", pk=gpu.node_id)

    def _respond(self, gpu: Gpu, *, form: ReasonForm | None, status: int, done: str = ""):
        if not htmx_partial(self.request):
            context = _page_context(self.request, gpu.node, gpu_errors={gpu.pk: form})
            return render_page(self.request, TEMPLATE, context, status=status)
        gpu.fresh = (
            gpu.last_sample_at is not None and gpu.last_sample_at >= selectors.telemetry_stale_before()
        )
        _mig_context(gpu)
        context = {"gpu": gpu, "node": gpu.node, "gpu_form": form, "done": done}
        return render_page(self.request, "nodes/_gpu_row.html", context, status=status)


class GpuMigView(StaffRequiredMixin, View):
    """POST ``enable``, ``profiles`` (a layout: profile names, space or comma separated; empty: an
    instance per workload) and ``reason``: the GPU's agent is asked to set them (audited), at once or
    once the GPU has drained. Refused with the reason in the row (400 for a layout the GPU cannot
    make, 409 while a change is pending)."""

    http_method_names = ["post"]

    def post(self, request, pk: int):
        gpu = get_object_or_404(Gpu.objects.select_related("node", "model"), pk=pk, removed_at__isnull=True)
        form = MigForm(request.POST)
        if not form.is_valid():
            return self._respond(gpu, form=form, status=400)
        try:
            command = gpu_mig_configure(
                gpu=gpu,
                enable=form.cleaned_data["enable"],
                profiles=form.cleaned_data["profiles"],
                actor=self.actor,
                reason=form.cleaned_data["reason"],
            )
        except DomainError as exc:
            gpu = Gpu.objects.select_related("node", "model").get(pk=gpu.pk)
            field = "profiles" if "profiles" in exc.fields else None
            form.add_error(field, exc.message)
            return self._respond(gpu, form=form, status=exc.status_code)
        if command is not None:
            message = f"GPU {gpu.index} of {gpu.node.hostname}: MIG change sent to its agent."
        else:
            message = (
                f"GPU {gpu.index} of {gpu.node.hostname} drains: it takes no new work, and the MIG change "
                "goes to its agent when its workloads have ended."
            )
        if htmx_partial(request):
            gpu = Gpu.objects.select_related("node", "model").get(pk=gpu.pk)
            return self._respond(gpu, form=None, status=200, done=message)
        messages.success(request, message)
        return redirect("nodes:node", pk=gpu.node_id)

    def _respond(self, gpu: Gpu, *, form: MigForm | None, status: int, done: str = ""):
        if not htmx_partial(self.request):
            context = _page_context(self.request, gpu.node, mig_errors={gpu.pk: form})
            return render_page(self.request, TEMPLATE, context, status=status)
        gpu.fresh = (
            gpu.last_sample_at is not None and gpu.last_sample_at >= selectors.telemetry_stale_before()
        )
        _mig_context(gpu, form)
        context = {"gpu": gpu, "node": gpu.node, "gpu_form": None, "mig_done": done}
        return render_page(self.request, "nodes/_gpu_row.html", context, status=status)


class GpuMigCancelView(StaffRequiredMixin, View):
    """POST ``reason``: drop a MIG change that still waits for the GPU to drain (audited)."""

    http_method_names = ["post"]

    def post(self, request, pk: int):
        gpu = get_object_or_404(Gpu.objects.select_related("node", "model"), pk=pk, removed_at__isnull=True)
        form = ReasonForm(request.POST)
        status, message = 200, ""
        if not form.is_valid():
            status, message = 400, " ".join(e for errors in form.errors.values() for e in errors)
        else:
            try:
                gpu_mig_cancel(gpu=gpu, actor=self.actor, reason=form.cleaned_data["reason"])
                message = (
                    f"GPU {gpu.index} of {gpu.node.hostname}: MIG change cancelled; it takes work again."
                )
            except DomainError as exc:
                status, message = exc.status_code, exc.message
        if not htmx_partial(request):
            (messages.success if status == 200 else messages.error)(request, message)
            return redirect("nodes:node", pk=gpu.node_id)
        gpu = Gpu.objects.select_related("node", "model").get(pk=gpu.pk)
        gpu.fresh = (
            gpu.last_sample_at is not None and gpu.last_sample_at >= selectors.telemetry_stale_before()
        )
        _mig_context(gpu)
        context = {"gpu": gpu, "node": gpu.node, "gpu_form": None}
        context["mig_done" if status == 200 else "mig_error"] = message
        return render_page(request, "nodes/_gpu_row.html", context, status=status)
