"""Placement constraints a request may carry, checked the same way by the live cycle and the simulator.

- ``node_selector``: only nodes whose labels hold every (key, value) pair.
- ``affinity`` / ``anti_affinity``: in (or out of) a topology domain that holds one of the named
  workloads of the same tenant. A domain is a node (``topology_key`` "node") or the nodes that share
  one value of a label (``"rack"``); a node without that label is in no domain. Another tenant's
  workloads never count, whatever ids a request names.
- ``spread``: the members of one group (an array's tasks, a gang's nodes) spread over the values of a
  label so that no domain holds more than ``max_skew`` members beyond the emptiest eligible domain.
- ``prefer``: the acceptable models ranked best first ("fastest": compute weight; "cheapest":
  compute weight per price); the index tries better-ranked models first, region penalty still first.

The engine turns the first three into a set of node indices a request may not use (on top of its
``avoid_nodes``, but hard), and a gang's spread into a choice of nodes; ``prefer`` becomes part of
the demand's class penalty. A request without constraints costs nothing here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal

from .types import GpuModelInfo, Node, Reason, Running

NODE = "node"
"""The topology key whose domains are single nodes."""

PREFERENCES = ("fastest", "cheapest")


@dataclass(frozen=True, slots=True)
class Term:
    """Affinity or anti-affinity to ``workloads`` (ids, the request's own tenant only)."""

    workloads: frozenset[str]
    topology_key: str = NODE


@dataclass(frozen=True, slots=True)
class Constraints:
    node_selector: tuple[tuple[str, str], ...] = ()
    affinity: Term | None = None
    anti_affinity: Term | None = None
    spread_key: str = ""
    max_skew: int = 1
    group: str = ""
    """The group whose members spread: an array's id (each task a request), or empty for a gang
    (its own nodes are the members)."""
    prefer: tuple[str, ...] = ()
    """Acceptable models, best first; empty: no preference."""

    @property
    def filters(self) -> bool:
        return bool(
            self.node_selector or self.affinity or self.anti_affinity or (self.spread_key and self.group)
        )


@dataclass(frozen=True, slots=True)
class Ranked:
    model: str
    compute_weight: float
    price: Decimal | None
    score: float


def rank_models(
    models: Iterable[str],
    catalog: dict[str, GpuModelInfo],
    preference: str,
    prices: dict[str, Decimal] | None = None,
) -> list[Ranked]:
    """The acceptable ``models`` ranked for ``preference``: "fastest" by compute weight, "cheapest"
    by compute weight per unit price (a model without a price ranks last); ties by name."""
    prices = prices or {}
    out = []
    for m in models:
        w = catalog[m].compute_weight if m in catalog else 1.0
        price = prices.get(m)
        score = (w / float(price) if price else 0.0) if preference == "cheapest" else w
        out.append(Ranked(m, w, price, score))
    out.sort(key=lambda r: (-r.score, r.model))
    return out


def node_matches(labels: dict[str, str], selector: Sequence[tuple[str, str]]) -> bool:
    return all(labels.get(k) == v for k, v in selector)


class ConstraintIndex:
    """Where each tenant's workloads and each group's members are, by node index, kept current
    across one cycle as placements are made."""

    def __init__(self, ids: Sequence[str], labels: Sequence[dict[str, str]], running: Iterable[Running]):
        self.ids = ids
        self.labels = labels
        self.index = {n: i for i, n in enumerate(ids)}
        self.where: dict[tuple[str, str], set[int]] = defaultdict(set)  # (tenant, workload) -> nodes
        self.members: dict[str, list[int]] = defaultdict(list)  # group -> a node per member
        for r in running:
            i = self.index.get(r.node_id)
            if i is None:
                continue
            self.where[(r.tenant, r.id)].add(i)
            if r.group:
                self.members[r.group].append(i)
                # An array job never runs itself: naming it names its tasks.
                self.where[(r.tenant, r.group)].add(i)

    @classmethod
    def for_nodes(cls, nodes: Sequence[Node], running: Iterable[Running]) -> ConstraintIndex:
        return cls([n.id for n in nodes], [n.labels for n in nodes], running)

    def domain(self, i: int, key: str) -> str | None:
        return self.ids[i] if key == NODE else self.labels[i].get(key)

    def record(self, tenant: str, request_id: str, nodes: Iterable[int], group: str = "") -> None:
        for i in nodes:
            self.where[(tenant, request_id)].add(i)
            if group:
                self.members[group].append(i)
                self.where[(tenant, group)].add(i)

    def _domains(self, tenant: str, term: Term) -> set[str]:
        out = set()
        for w in term.workloads:
            for i in self.where.get((tenant, w), ()):
                d = self.domain(i, term.topology_key)
                if d is not None:
                    out.add(d)
        return out

    def forbidden(
        self, tenant: str, c: Constraints, candidates: Iterable[int]
    ) -> tuple[frozenset[int], tuple[Reason, str] | None]:
        """The candidate nodes ``c`` rules out, and, when it rules out all of them, why."""
        cands = list(candidates)
        out: set[int] = set()
        reason = None
        if c.node_selector:
            bad = {i for i in cands if not node_matches(self.labels[i], c.node_selector)}
            out |= bad
            if len(out) == len(cands):
                sel = ",".join(f"{k}={v}" for k, v in c.node_selector)
                reason = (Reason.NODE_SELECTOR, f"no server with labels {sel} can take it")
        if c.affinity is not None and reason is None:
            want = self._domains(tenant, c.affinity)
            out |= {i for i in cands if self.domain(i, c.affinity.topology_key) not in want}
            if len(out) == len(cands):
                reason = (
                    Reason.AFFINITY,
                    f"no server in a {c.affinity.topology_key} of its affinity workloads can take it",
                )
        if c.anti_affinity is not None and reason is None:
            avoid = self._domains(tenant, c.anti_affinity)
            out |= {i for i in cands if self.domain(i, c.anti_affinity.topology_key) in avoid}
            if len(out) == len(cands):
                reason = (
                    Reason.ANTI_AFFINITY,
                    f"every {c.anti_affinity.topology_key} that could take it holds an anti-affinity workload",
                )
        if c.spread_key and c.group and reason is None:
            eligible = [i for i in cands if i not in out and self.domain(i, c.spread_key) is not None]
            counts: dict[str, int] = dict.fromkeys((self.domain(i, c.spread_key) for i in eligible), 0)
            for i in self.members.get(c.group, ()):
                d = self.domain(i, c.spread_key)
                if d in counts:
                    counts[d] += 1
            low = min(counts.values(), default=0)
            ok = {d for d, n in counts.items() if n + 1 - low <= c.max_skew}
            out |= {i for i in cands if self.domain(i, c.spread_key) not in ok}
            if len(out) == len(cands):
                reason = (Reason.SPREAD, f"no {c.spread_key} keeps its group within max_skew {c.max_skew}")
        return frozenset(out), reason

    def spread_pick(self, members: Sequence[int], need: int, key: str, max_skew: int) -> list[int] | None:
        """``need`` of ``members`` (nodes, in preference order) spread over the values of label
        ``key``: round robin over the domains, so that the counts differ by at most ``max_skew``
        among the domains offered; None when they cannot."""
        by: dict[str, list[int]] = {}
        for i in members:
            d = self.domain(i, key)
            if d is not None:
                by.setdefault(d, []).append(i)
        if not by:
            return None
        order = sorted(by)
        counts = dict.fromkeys(order, 0)
        chosen: list[int] = []
        while len(chosen) < need:
            open_ = [d for d in order if counts[d] < len(by[d])]
            if not open_:
                return None
            d = min(open_, key=lambda x: counts[x])
            chosen.append(by[d][counts[d]])
            counts[d] += 1
        if max(counts.values()) - min(counts.values()) > max_skew:
            return None
        return chosen
