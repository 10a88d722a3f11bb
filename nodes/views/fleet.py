"""The fleet overview: nodes by state and region, GPUs by model and health, the utilisation heat
map, open alerts and unknown GPUs, and the node table (filters, pagination).

A fixed number of queries whatever the fleet's size; htmx requests from the filter form and the
pager get the table alone.
"""

from __future__ import annotations

from django import forms
from django.core.paginator import Paginator
from django.db.models import Exists, OuterRef
from django.utils import timezone
from django.views.generic import View

from nodes import selectors
from nodes.models import Gpu, GpuModel, NodeState, Region
from nodes.views.base import StaffRequiredMixin
from nodes.views.heatmap import heatmap_html, heatmap_meta
from portal.views.base import htmx_partial, render_page

PAGE_SIZE = 50


class FleetFilterForm(forms.Form):
    q = forms.CharField(label="Hostname", required=False, max_length=100)
    region = forms.ChoiceField(label="Region", required=False)
    state = forms.ChoiceField(label="State", required=False, choices=[("", "Any state"), *NodeState.choices])
    model = forms.ModelChoiceField(label="GPU model", required=False, queryset=GpuModel.objects.none())

    def __init__(self, *args, regions: list[tuple[str, str]], models, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["region"].choices = [("", "Any region"), *regions]
        self.fields["model"].queryset = models
        self.fields["model"].empty_label = "Any model"
        for field in self.fields.values():
            field.widget.attrs["class"] = (
                "select-sm" if not isinstance(field, forms.CharField) else "input-sm"
            )

    def filters(self) -> selectors.FleetFilters:
        data = self.cleaned_data
        return selectors.FleetFilters(
            region=data.get("region") or "",
            state=data.get("state") or "",
            model=data["model"].pk if data.get("model") else None,
            q=(data.get("q") or "").strip(),
        )


def _models_present():
    return GpuModel.objects.filter(
        Exists(Gpu.objects.filter(model=OuterRef("pk"), removed_at__isnull=True))
    ).order_by("vendor", "name")


class FleetOverviewView(StaffRequiredMixin, View):
    template_name = "nodes/fleet.html"
    partial_template_name = "nodes/_node_rows.html"

    def get(self, request):
        regions = list(Region.objects.order_by("code").values_list("code", "code"))
        form = FleetFilterForm(request.GET or None, regions=regions, models=_models_present())
        status = 200
        filters = selectors.FleetFilters()
        if form.is_bound:
            if form.is_valid():
                filters = form.filters()
            else:
                status = 400
        paginator = Paginator(selectors.fleet_nodes(filters=filters), PAGE_SIZE)
        page = paginator.get_page(request.GET.get("page"))
        nodes = list(page.object_list)
        stats = selectors.fleet_node_stats(node_ids=[n.pk for n in nodes])
        for n in nodes:
            st = stats.get(n.pk) or selectors.NodeStats()
            n.gpu_count, n.gpu_attention, n.util_avg = st.gpu_count, st.gpu_attention, st.util_avg
            n.model_summary = st.models or []
        context = {
            "form": form,
            "filters": filters,
            "page": page,
            "nodes": nodes,
            "paginator": paginator,
        }
        if not htmx_partial(request):
            heatmap = selectors.fleet_heatmap()
            context.update(
                counts=selectors.fleet_node_counts(),
                gpu_counts=selectors.fleet_gpu_counts(),
                alerts=selectors.fleet_alerts_open(),
                unknown_gpus=selectors.unknown_gpu_reports_open(),
                heatmap=heatmap,
                heatmap_html=heatmap_html(heatmap),
                live_initial={
                    "type": "fleet.initial",
                    "ts": int(timezone.now().timestamp()),
                    "g": [
                        [g.id, g.util, g.mem_gib, g.power_w, g.temp_c]
                        for r in heatmap.regions
                        for n in r.nodes
                        for g in n.gpus
                    ],
                    **heatmap_meta(heatmap),
                },
                states=NodeState.choices,
            )
        return render_page(
            request,
            self.template_name,
            context,
            partial_template_name=self.partial_template_name,
            status=status,
        )
