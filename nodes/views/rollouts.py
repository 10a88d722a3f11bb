"""The staff Rollouts pages (``/fleet/rollouts/``): campaigns with their progress and a form to start
one; a campaign's page with each node's step and the pause, resume and abort buttons. Every write goes
through ``nodes.services.rollouts`` (validated, locked, audited); a refusal answers 400 or 409 with
the message on the page and changes nothing. The detail refreshes itself while the campaign is open."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.db.models import Count
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect
from django.views.generic import View

from nodes.models import GpuModel, Region, RolloutCampaign, RolloutStep, RolloutStepState
from nodes.services import rollouts
from nodes.views.base import StaffRequiredMixin
from portal.errors import DomainError
from portal.views.base import htmx_partial, render_page

ACTIONS = {
    "pause": rollouts.rollout_pause,
    "resume": rollouts.rollout_resume,
    "abort": rollouts.rollout_abort,
}
REFRESH_S = 5


class RolloutForm(forms.Form):
    """The start form; the service checks every field again (and is what the API calls)."""

    name = forms.CharField(max_length=100)
    upgrade = forms.CharField(
        max_length=64, help_text="The name of an upgrade in the agents' `upgrades` table (never a command)."
    )
    gpu_model = forms.ChoiceField(label="GPU model", required=False)
    region = forms.ChoiceField(required=False)
    label = forms.CharField(
        required=False, max_length=320, help_text="key=value, matched against node labels."
    )
    batch_size = forms.IntegerField(min_value=1, max_value=rollouts.MAX_BATCH_SIZE, initial=1)
    max_region_share = forms.CharField(
        label="Most of a region out at once",
        initial="25%",
        max_length=16,
        help_text='A fraction ("0.25") or "25%".',
    )
    drain_deadline_s = forms.IntegerField(
        label="Drain deadline (s)", min_value=0, max_value=rollouts.MAX_DRAIN_DEADLINE_S, initial=3600,
        help_text="Jobs may finish within it; instances are told at once; the rest is preempted then.",
    )  # fmt: skip
    step_timeout_s = forms.IntegerField(
        label="Upgrade and check timeout (s)", min_value=rollouts.MIN_STEP_TIMEOUT_S,
        max_value=rollouts.MAX_STEP_TIMEOUT_S, initial=rollouts.DEFAULT_STEP_TIMEOUT_S,
    )  # fmt: skip

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["gpu_model"].choices = [
            ("", "Any model"),
            *((m, m) for m in GpuModel.objects.values_list("name", flat=True)),
        ]
        self.fields["region"].choices = [("", "Any region"), *Region.objects.values_list("code", "code")]

    def data_for_service(self) -> dict:
        return {k: v for k, v in self.cleaned_data.items() if v not in ("", None)}


def _campaigns() -> list[RolloutCampaign]:
    campaigns = list(RolloutCampaign.objects.select_related("gpu_model", "region", "created_by")[:100])
    counts: dict[int, dict[str, int]] = {}
    for campaign_id, state, n in (
        RolloutStep.objects.filter(campaign__in=campaigns)
        .values_list("campaign_id", "state")
        .annotate(n=Count("id"))
        .order_by()
    ):
        counts.setdefault(campaign_id, {})[state] = n
    for c in campaigns:
        c.counts = counts.get(c.pk, {})
        c.total = sum(c.counts.values())
        c.done = c.counts.get(RolloutStepState.RETURNED, 0)
        c.selector = rollouts.rollout_selector_text(c)
    return campaigns


class RolloutListView(StaffRequiredMixin, View):
    template_name = "nodes/rollouts.html"

    def get(self, request):
        return render_page(request, self.template_name, {"campaigns": _campaigns(), "form": RolloutForm()})

    def post(self, request):
        form = RolloutForm(request.POST)
        if form.is_valid():
            try:
                campaign = rollouts.rollout_start(data=form.data_for_service(), actor=self.actor)
            except DomainError as exc:
                for name, errors in exc.fields.items():
                    form.add_error(name if name in form.fields else None, " ".join(map(str, errors)))
            else:
                messages.success(
                    request, f"Rollout {campaign.name} started over {campaign.steps.count()} node(s)."
                )
                return redirect("nodes:rollout", pk=campaign.pk)
        return render_page(request, self.template_name, {"campaigns": _campaigns(), "form": form}, status=400)


def _detail_context(campaign: RolloutCampaign, *, error: str = "") -> dict:
    steps = list(campaign.steps.select_related("node__region").order_by("position"))
    counts = dict.fromkeys(RolloutStepState.values, 0)
    for step in steps:
        counts[step.state] += 1
    return {
        "campaign": campaign,
        "selector": rollouts.rollout_selector_text(campaign),
        "steps": steps,
        "counts": counts,
        "done": counts[RolloutStepState.RETURNED],
        "total": len(steps),
        "actions": [a for a in ACTIONS if _allowed(campaign, a)],
        "refresh_s": REFRESH_S
        if campaign.is_open or any(s.state in ("draining", "upgrading", "checking") for s in steps)
        else 0,
        "error": error,
    }


def _allowed(campaign: RolloutCampaign, action: str) -> bool:
    if action == "pause":
        return campaign.state == "running"
    if action == "resume":
        return campaign.state == "paused"
    return campaign.is_open


def _campaign(pk: int) -> RolloutCampaign:
    return get_object_or_404(
        RolloutCampaign.objects.select_related("gpu_model", "region", "created_by"), pk=pk
    )


class RolloutDetailView(StaffRequiredMixin, View):
    """The campaign and its nodes; an htmx request (the page's own refresh) gets the progress alone."""

    def get(self, request, pk: int):
        context = _detail_context(_campaign(pk))
        if htmx_partial(request):
            return render_page(request, "nodes/_rollout_progress.html", context)
        return render_page(request, "nodes/rollout_detail.html", context)


class RolloutActionView(StaffRequiredMixin, View):
    http_method_names = ["post"]

    def post(self, request, pk: int, action: str):
        if action not in ACTIONS:
            raise Http404("No such action.")
        campaign = _campaign(pk)
        reason = request.POST.get("reason", "").strip()[:2000]
        try:
            ACTIONS[action](campaign=campaign, actor=self.actor, reason=reason)
        except DomainError as exc:
            context = _detail_context(_campaign(pk), error=exc.message)
            return render_page(request, "nodes/rollout_detail.html", context, status=exc.status_code)
        messages.success(request, f"Rollout {campaign.name}: {action} done.")
        return redirect("nodes:rollout", pk=pk)
