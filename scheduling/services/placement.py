"""A request's placement constraints, validated: node selector, affinity, anti-affinity, spread and
model preference (the rules themselves are ``scheduling.engine.constraints``).

Selectors match only the labels agents registered, never other node fields. Affinity names the
tenant's own workloads by id: an id of another tenant's workload is refused exactly like an id that
does not exist, so the answer tells nothing about other tenants.
"""

from __future__ import annotations

from typing import Any

from nodes.validation import LABEL_KEY, clean_labels
from portal.errors import ValidationFailed
from scheduling.engine.constraints import NODE, PREFERENCES, Constraints, Ranked, Term, rank_models
from scheduling.engine.types import GpuModelInfo
from scheduling.models import Workload
from scheduling.pricing import gpu_price_table, price_key

MAX_SELECTOR = 16
MAX_TERM_WORKLOADS = 32
MAX_SKEW = 64


def _fail(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", fields={field: [message]})


def _topology_key(raw: dict, field: str) -> str:
    key = raw.get("topology_key", NODE)
    if not isinstance(key, str) or not (key == NODE or LABEL_KEY.fullmatch(key)):
        raise _fail(f"{field}.topology_key", '"node" or a node label key.')
    return key


def _term(*, tenant, raw: Any, field: str) -> dict:
    if raw is None or raw == {}:
        return {}
    if not isinstance(raw, dict) or set(raw) - {"workloads", "topology_key"}:
        raise _fail(field, 'An object: {"workloads": [ids], "topology_key": "node" or a label key}.')
    ids = raw.get("workloads")
    if (
        not isinstance(ids, list)
        or not ids
        or len(ids) > MAX_TERM_WORKLOADS
        or not all(isinstance(i, int) and not isinstance(i, bool) and 0 < i < 1 << 62 for i in ids)
    ):
        raise _fail(f"{field}.workloads", f"A list of 1-{MAX_TERM_WORKLOADS} workload ids.")
    ids = sorted(set(ids))
    mine = set(Workload.objects.for_tenant(tenant).filter(pk__in=ids).values_list("pk", flat=True))
    missing = [i for i in ids if i not in mine]
    if missing:
        raise _fail(f"{field}.workloads", f"No workload of yours with id {missing[0]}.")
    return {"workloads": ids, "topology_key": _topology_key(raw, field)}


def placement_validate(*, tenant, spec: dict, f: dict[str, Any], candidates: list) -> dict[str, Any]:
    """The placement fields of ``spec`` as stored; ``f`` holds the fields validated before
    (gang, array_count), ``candidates`` the acceptable GPU models."""
    out: dict[str, Any] = {}
    raw = spec.get("node_selector")
    out["node_selector"] = {} if raw is None else clean_labels(raw, "node_selector", max_items=MAX_SELECTOR)
    out["affinity"] = _term(tenant=tenant, raw=spec.get("affinity"), field="affinity")
    out["anti_affinity"] = _term(tenant=tenant, raw=spec.get("anti_affinity"), field="anti_affinity")
    raw = spec.get("spread")
    out["spread"] = {}
    if raw is not None and raw != {}:
        if not isinstance(raw, dict) or set(raw) - {"topology_key", "max_skew"} or "topology_key" not in raw:
            raise _fail("spread", 'An object: {"topology_key": "rack", "max_skew": 1}.')
        if not f.get("gang") and f.get("array_count") is None:
            raise _fail("spread", "Only an array's tasks or a gang's nodes are spread.")
        skew = raw.get("max_skew", 1)
        if isinstance(skew, bool) or not isinstance(skew, int) or not 1 <= skew <= MAX_SKEW:
            raise _fail("spread.max_skew", f"An integer 1-{MAX_SKEW}.")
        out["spread"] = {"topology_key": _topology_key(raw, "spread"), "max_skew": skew}
    pref = spec.get("preference")
    if pref is None or pref == "":
        out["preference"] = ""
    elif pref not in PREFERENCES:
        raise _fail("preference", f"One of {', '.join(PREFERENCES)}.")
    elif len(candidates) < 2:
        raise _fail("preference", "The request allows only one GPU model: nothing to prefer.")
    else:
        out["preference"] = pref
    return out


def placement_prices(*, models: list, region, plan: str) -> dict[str, Any]:
    """The ``plan`` price (else on-demand) per GPU-hour of each of ``models`` (GpuModel rows) by
    name: in ``region``, or without one the lowest among the regions that have servers of it (the
    price "cheapest" divides compute weight by), and the region that price is in."""
    return {name: price for name, (price, _r) in _prices_where(models, region, plan).items()}


def _prices_where(models: list, region, plan: str) -> dict[str, tuple[Any, Any]]:
    from nodes.models import NodeState, Region

    pairs = []
    for m in models:
        regions = (
            [region]
            if region is not None
            else list(
                Region.objects.filter(nodes__state=NodeState.READY, nodes__gpus__model=m)
                .distinct()
                .order_by("code")
            )
        )
        pairs.extend((m, r) for r in regions)
    table = gpu_price_table(pairs=pairs)
    out: dict[str, tuple[Any, Any]] = {}
    for m, r in pairs:
        row = table[price_key(m, r)]
        price = row.get(plan) or row.get("on_demand")
        if price is not None and (m.name not in out or price < out[m.name][0]):
            out[m.name] = (price, r)
        elif m.name not in out:
            out[m.name] = (None, r)
    return {k: v for k, v in out.items() if v[0] is not None} | {k: v for k, v in out.items() if v[0] is None}


def placement_constraints(
    *, workload: Workload, allowed: list[str], catalog: dict, prices: dict | None = None
) -> Constraints | None:
    """The engine's ``Constraints`` for a stored workload (None when it has none); ``allowed`` the
    names of the models it may use, ``prices`` by name for "cheapest"."""
    w = workload
    if not (w.node_selector or w.affinity or w.anti_affinity or w.spread or w.preference):
        return None

    def term(raw: dict) -> Term | None:
        if not raw:
            return None
        return Term(frozenset(str(i) for i in raw["workloads"]), raw.get("topology_key") or NODE)

    prefer: tuple[str, ...] = ()
    if w.preference and len(allowed) > 1:
        prefer = tuple(r.model for r in rank_models(allowed, catalog, w.preference, prices))
    return Constraints(
        node_selector=tuple(sorted((str(k), str(v)) for k, v in w.node_selector.items())),
        affinity=term(w.affinity),
        anti_affinity=term(w.anti_affinity),
        spread_key=(w.spread or {}).get("topology_key", ""),
        max_skew=(w.spread or {}).get("max_skew", 1),
        group=str(w.array_parent_id) if w.spread and w.array_parent_id else "",
        prefer=prefer,
    )


def placement_explain(*, models: list, region, preference: str) -> dict[str, Any]:
    """What the scheduler would choose among ``models`` (GpuModel rows) for ``preference`` (or
    none), and why: the ranked candidates with their compute weight and on-demand price per GPU-hour
    in ``region`` (None: without a region), and the region it would look in first (the one asked
    for, else the first by code that has a READY server of the chosen model)."""
    catalog = {m.name: m for m in models}
    where_prices = _prices_where(models, region, "on_demand")
    prices = {k: p for k, (p, _r) in where_prices.items() if p is not None}
    info = {m.name: GpuModelInfo(m.name, compute_weight=float(m.compute_weight)) for m in models}
    if preference:
        ranked = rank_models(list(catalog), info, preference, prices)
        why = (
            "highest compute weight"
            if preference == "fastest"
            else "highest compute weight per on-demand price"
        )
    else:
        ranked = [
            Ranked(m.name, float(m.compute_weight), prices.get(m.name), 0.0)
            for m in sorted(models, key=lambda m: m.name)
        ]
        why = "no preference: any of these models, wherever capacity packs best"
    chosen = ranked[0].model
    where = where_prices.get(chosen, (None, region))[1]
    return {
        "preference": preference or None,
        "gpu_model": chosen,
        "region": where.code if where is not None else None,
        "reason": why,
        "candidates": [
            {
                "gpu_model": r.model,
                "compute_weight": f"{r.compute_weight:.2f}",
                "price_per_gpu_hour": None if r.price is None else str(r.price),
                "score": round(r.score, 6),
            }
            for r in ranked
        ],
    }
