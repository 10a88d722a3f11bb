"""One scheduling cycle: a snapshot and the pending queue in, a list of decisions out.

Requests are tried in fair-queue order (see ``queueing``). A request is placed by the policy if it
fits; otherwise, if it may preempt, on the node whose lower-priority victims are cheapest; otherwise
it stays pending with a reason. Elastic jobs are shrunk toward their minimum before anyone is
preempted, and grown into idle GPUs once the queue is served (``elastic``; ``Resize`` decisions).
The first request that cannot start becomes the *head*: where the running work's estimated ends
tell when it could start, the nodes it will need are held for it, and later (smaller) work may start
on them only if its own estimate ends before that time (backfill), so it never delays the head's
reserved start.

A request's ``avoid_nodes`` (nodes that failed to start it) are not chosen, by placement, backfill or
preemption, unless no other node could ever take it: then they may be chosen again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

from .constraints import ConstraintIndex, Constraints
from .elastic import Elastic
from .fragmentation import Distribution
from .policies import DEFAULT_POLICY, get_policy
from .preemption import Preemptor
from .queueing import FairQueue, FairShare, QueueConfig
from .spec import ACCESS_LEND, Demand, allowed_models, split_sizes, validate
from .state import ClusterState, Slot, gpu_options
from .types import (
    MILLI,
    Assignment,
    Decision,
    GpuModelInfo,
    GpuSpec,
    Node,
    Pending,
    Place,
    Plan,
    Reason,
    Request,
    Running,
    Snapshot,
)


@dataclass(frozen=True, slots=True)
class CycleConfig:
    policy: str = DEFAULT_POLICY
    queue: QueueConfig = field(default_factory=QueueConfig)
    backfill: bool = True
    preemption: bool = True
    expected_start_limit: int = 64
    """At most this many distinct pending demands get an expected start computed per cycle."""
    seed: int = 0
    elastic: bool = True
    """Shrink elastic jobs before preempting, and grow them into idle GPUs (``elastic``)."""


class Engine:
    """A placement index that lives across cycles (the simulator keeps one; the live scheduler may
    build one per cycle from a snapshot with ``schedule``)."""

    def __init__(
        self,
        nodes: Sequence[Node],
        models: dict[str, GpuModelInfo],
        config: CycleConfig | None = None,
        workload: Distribution | None = None,
    ) -> None:
        self.config = config or CycleConfig()
        self.models = models
        self.nodes = list(nodes)
        self.policy = get_policy(self.config.policy)
        self.state = ClusterState(self.nodes, models, self.policy, seed=self.config.seed)
        self.reserved_for = {n.id: n.reserved_for for n in self.nodes}
        self._allowed: dict[GpuSpec, frozenset[str]] = {}
        self._demands: dict[tuple, Demand] = {}
        self._workload_fixed = workload is not None
        self._fair_base: tuple | None = None
        self.now = 0.0
        if workload is not None:
            self.policy.set_distribution(workload)

    # -- demands -------------------------------------------------------------------------------------

    def demand(self, r: Request) -> Demand:
        k = (
            r.gpu,
            r.gpus,
            r.milli,
            r.gang,
            r.cpu_milli,
            r.memory_mib,
            r.region,
            r.other_regions_ok,
            r.plan,
            r.tenant,
            r.excluded,
            r.gpus_per_node,
            r.split_regions_ok,
            r.constraints.prefer if r.constraints is not None else (),
            r.min_versions,
        )
        d = self._demands.get(k)
        if d is None:
            models = self._allowed.get(r.gpu)
            if models is None:
                models = self._allowed[r.gpu] = allowed_models(r.gpu, self.models)
            if r.plan == Plan.RESERVED:
                access = r.tenant
            elif r.plan in (Plan.SPOT, Plan.WARM_POOL):
                access = ACCESS_LEND
            else:
                access = ""
            d = self._demands[k] = Demand(
                models,
                r.milli,
                r.gpus,
                r.cpu_milli,
                r.memory_mib,
                r.gang,
                r.region,
                r.other_regions_ok,
                access,
                r.gpu.mig_profile or "",
                r.excluded,
                split_sizes(r),
                r.split_regions_ok,
                r.constraints.prefer if r.constraints is not None else (),
                r.min_versions,
            )
        return d

    def set_workload(self, dist: Distribution) -> None:
        self.policy.set_distribution(dist)
        self.state.invalidate()
        self._workload_fixed = True

    # -- capacity bookkeeping ------------------------------------------------------------------------------

    def release(self, assignments: Sequence[Assignment]) -> None:
        """Give back what a finished workload held."""
        st = self.state
        for a in assignments:
            i = st.index[a.node_id]
            idx = st.gpu_index[i]
            st.release(
                Slot(
                    i,
                    tuple(idx.index(g) for g in a.gpu_indices),
                    a.milli,
                    a.cpu_milli,
                    a.memory_mib,
                    a.mig_use,
                    -1 if a.mig_start is None else a.mig_start,
                )
            )

    def _avoid(self, req: Request, d: Demand) -> frozenset[int]:
        """The node indices ``req`` should not be placed on: none when only they could ever take it."""
        st = self.state
        avoid = frozenset(st.index[n] for n in req.avoid_nodes if n in st.index)
        if not avoid:
            return avoid
        fit = st.class_fit(d)
        for i in range(len(st.ids)):
            if i not in avoid and fit[st.ncls[i]] is not None and (st.keys[i] is not None or i in st.held):
                return avoid
        return frozenset()

    def _assignment(self, s: Slot) -> Assignment:
        st = self.state
        idx = st.gpu_index[s.node]
        return Assignment(
            st.ids[s.node],
            tuple(idx[p] for p in s.positions),
            s.milli,
            s.cpu,
            s.mem,
            s.mig_start if s.mig else None,
            s.mig,
        )

    # -- reasons and expected starts --------------------------------------------------------------------

    def why(self, d: Demand) -> tuple[Reason, str]:
        st = self.state
        piece = min(d.per_node, default=d.gpus)
        model_ok = [
            c
            for c in st.classes
            if (not d.gpus or c.model in d.models)
            and (c.gpu_count and d.gpus % c.gpu_count == 0 if d.gang else min(d.gpus, piece) <= c.gpu_count)
        ]
        if not model_ok:
            what = ", ".join(sorted(d.models)) or "none"
            return (
                Reason.NO_MATCHING_MODEL,
                f"no server offers {d.gpus} GPU(s) of an acceptable model ({what})",
            )
        fit = st.class_fit(d)
        if not any(fit[c.id] is not None for c in model_ok):
            if d.min_versions and not any(c.software.meets(d.min_versions) for c in model_ok):
                return Reason.VERSIONS, _versions_message(d, model_ok)
            if d.excluded and all((c.model, c.region) in d.excluded for c in model_ok):
                return Reason.PRICE, "the spot price is above the request's maximum wherever it could run"
            if d.access not in ("", ACCESS_LEND) and not any(c.reserved_for == d.access for c in model_ok):
                return Reason.RESERVATION, "no reserved capacity of this tenant matches the request"
            if d.region is not None and not d.other_regions_ok:
                return Reason.REGION, f"no matching server in region {d.region}"
            return Reason.CAPACITY, "no matching server has enough CPU or RAM for this request"
        if d.gang:
            return Reason.GANG, f"needs {d.gpus} GPUs on whole free servers at once"
        return Reason.CAPACITY, "no READY server has enough free capacity of an acceptable model now"

    def _node_ready_at(self, i: int, d: Demand, ends: list[tuple[float, Slot]], whole: bool) -> float | None:
        """Earliest time node ``i`` alone can host ``d`` if its running work ends as estimated."""
        st = self.state
        cls = st.classes[st.ncls[i]]
        g = list(st.gfree[i])
        ms = None if st.mstate[i] is None else list(st.mstate[i])
        cpu, mem = st.cpu_free[i], st.mem_free[i]

        def fits() -> bool:
            if cpu < d.cpu or mem < d.mem:
                return False
            if whole:
                return ms is None and all(x == MILLI for x in g) and not st.kept(cls.id, d)
            gk, mk = st.gkeys(i, g, ms)
            return bool(st.keeping(cls.id, d, gpu_options(cls, gk, d, mk)))

        if fits():
            return self.now
        off = st.off[i]
        for t, s in ends:
            for p in s.positions:
                if p in off:
                    continue  # ends there free nothing: the GPU takes no work
                g[p] += s.milli
                if s.mig and ms is not None:
                    ms[p] -= s.mig
            cpu += s.cpu
            mem += s.mem
            if fits():
                return t
        return None

    def reservation_for(self, d: Demand, ends_by_node: dict[int, list[tuple[float, Slot]]]):
        """(start time, nodes) at which ``d`` could start as running work ends, or None."""
        st = self.state
        fit = st.class_fit(d)
        times: list[tuple[float, int]] = []
        for i, ends in ends_by_node.items():
            if fit[st.ncls[i]] is None:
                continue
            t = self._node_ready_at(i, d, ends, d.gang)
            if t is not None:
                times.append((t, i))
        if not times:
            return None
        times.sort()
        if d.gang:
            by_group: dict[tuple[str, str], list[tuple[float, int]]] = {}
            for t, i in times:
                c = st.classes[st.ncls[i]]
                by_group.setdefault((c.model, c.region), []).append((t, i))
            best = None
            for (_m, _r), lst in by_group.items():
                per = st.classes[st.ncls[lst[0][1]]].gpu_count
                need = d.gpus // per
                free_now = [i for key, b in st.buckets.items() for i in b if fit[key[0]] is not None]
                whole_now = [
                    i for i in free_now if all(x == MILLI for x in st.gfree[i]) and i not in ends_by_node
                ]
                pool = [(self.now, i) for i in whole_now] + lst
                pool.sort()
                if len(pool) >= need:
                    cand = (pool[need - 1][0], [i for _, i in pool[:need]])
                    if best is None or cand[0] < best[0]:
                        best = cand
            return best
        return times[0][0], [times[0][1]]

    # -- the cycle ------------------------------------------------------------------------------------

    def cycle(
        self,
        pending: Sequence[Request],
        running: Sequence[Running] = (),
        now: float = 0.0,
        tenant_weights: dict[str, float] | None = None,
    ) -> list[Decision]:
        cfg = self.config
        st = self.state
        self.now = now
        if not self._workload_fixed:
            self.policy.set_distribution(Distribution.from_demands(self.demand(r) for r in pending))
            st.invalidate()
        if self._fair_base is None:
            self._fair_base = FairShare.base(self.nodes, self.models)
        # Elastic jobs lend what they hold above their minimum before anything else looks (fair
        # share, backfill estimates, preemption, placement): borrowed GPUs are idle capacity.
        elastic = Elastic(st, self.nodes, running) if cfg.elastic and running else None
        if elastic:
            elastic.lend()
        fair = FairShare(self.nodes, self.models, list(running), tenant_weights or {}, self._fair_base)
        queue = FairQueue(list(pending), fair, now, cfg.queue)
        preemptor = (
            Preemptor(st, list(running), self.reserved_for, now) if cfg.preemption and running else None
        )

        ends_by_node: dict[int, list[tuple[float, Slot]]] = {}
        for r in running:
            if r.est_end is None:
                continue
            i = st.index.get(r.node_id)
            if i is None:
                continue
            slot = st.slot_for(
                i, r.gpu_indices, r.milli, r.cpu_milli, r.memory_mib, r.mig_profile, r.mig_start
            )
            ends_by_node.setdefault(i, []).append((max(r.est_end, now), slot))
        for lst in ends_by_node.values():
            lst.sort(key=lambda e: e[0])

        cons: ConstraintIndex | None = None
        if any(
            r.constraints is not None and (r.constraints.filters or r.constraints.spread_key) for r in pending
        ):
            cons = ConstraintIndex(st.ids, [n.labels for n in self.nodes], running)

        decisions: list[Decision] = []
        failed: set[Demand] = set()
        head_start: float | None = None
        held: list[int] = []
        expected: dict[Demand, float | None] = {}
        reasons: dict[Demand, tuple[Reason, str]] = {}

        def placed(req: Request, slots: Sequence[Slot], backfill: bool = False, preempt: tuple = ()) -> None:
            """Record a placement: shrink the elastic jobs whose borrowed GPUs it takes, first."""
            if elastic:
                slots, resizes = elastic.claim(slots, req.id, preempt)
                decisions.extend(resizes)
            if cons is not None:
                c = req.constraints
                cons.record(req.tenant, req.id, (s.node for s in slots), c.group if c else "")
            decisions.append(
                Place(req.id, tuple(self._assignment(s) for s in slots), preempt=preempt, backfill=backfill)
            )
            for s in slots:
                fair.add(req.tenant, st.ids[s.node], len(s.positions) * s.milli, s.cpu, s.mem)

        try:
            for _cls, req in queue:
                bad = validate(req)
                if bad is not None:
                    decisions.append(Pending(req.id, Reason.INVALID, bad))
                    continue
                d = self.demand(req)
                avoid = self._avoid(req, d) if req.avoid_nodes else frozenset()
                c = req.constraints
                pick = None
                narrowed = False
                if cons is not None and c is not None:
                    forbid, unmet = self._forbidden(cons, req, c, d)
                    if unmet is not None:
                        decisions.append(Pending(req.id, unmet[0], unmet[1]))
                        continue
                    if forbid:
                        avoid = avoid | forbid
                        narrowed = True
                    if d.gang and c.spread_key:
                        pick = partial(cons.spread_pick, key=c.spread_key, max_skew=c.max_skew)
                        narrowed = True
                slots = None if d in failed else st.place(d, avoid, pick)
                if slots is None and d.per_node and d not in failed:
                    slots = st.place_split(d, avoid)
                if slots is not None:
                    placed(req, slots)
                    continue
                if not avoid and pick is None:
                    failed.add(d)
                if (
                    held
                    and not d.gang
                    and req.est_runtime is not None
                    and head_start is not None
                    and now + req.est_runtime <= head_start
                ):
                    slot = self._place_on_held([i for i in held if i not in avoid], d)
                    if slot is not None:
                        placed(req, [slot], backfill=True)
                        continue
                if elastic and pick is None:
                    shrunk = elastic.shrink_for(d, int(req.priority_class), req.tenant, req.id, avoid)
                    if shrunk is not None:
                        slot, resizes = shrunk
                        decisions += resizes
                        placed(req, [slot])
                        continue
                if preemptor is not None and pick is None:
                    choice = preemptor.find(d, int(req.priority_class), avoid)
                    if choice is not None:
                        slots = preemptor.apply(choice, d)
                        placed(req, slots, preempt=tuple(dict.fromkeys(v.id for v in choice.victims)))
                        continue
                reason = reasons.get(d)
                if reason is None:
                    reason = reasons[d] = self.why(d)
                if narrowed and reason[0] in (Reason.CAPACITY, Reason.GANG):
                    # Free capacity may exist, only not where its constraints allow.
                    decisions.append(Pending(req.id, *self._narrowed_reason(c, reason)))
                    continue
                if head_start is None and cfg.backfill and reason[0] in (Reason.CAPACITY, Reason.GANG):
                    res = self.reservation_for(d, ends_by_node)
                    if res is not None:
                        head_start, nodes = res
                        for i in nodes:
                            st.hold(i)
                            held.append(i)
                        decisions.append(Pending(req.id, reason[0], reason[1], expected_start=head_start))
                        continue
                if (
                    d not in expected
                    and len(expected) < cfg.expected_start_limit
                    and reason[0]
                    in (
                        Reason.CAPACITY,
                        Reason.GANG,
                    )
                ):
                    res = self.reservation_for(d, ends_by_node)
                    expected[d] = None if res is None else max(res[0], head_start or res[0])
                if held and self._fits_held(held, d):
                    decisions.append(
                        Pending(
                            req.id,
                            Reason.BLOCKED_BY_HEAD,
                            "free capacity is held for an earlier request; this one would delay it",
                            expected_start=expected.get(d),
                        )
                    )
                else:
                    decisions.append(Pending(req.id, reason[0], reason[1], expected_start=expected.get(d)))
            if elastic:
                elastic.give_back()
                decisions += elastic.grow()
        finally:
            for i in held:
                st.unhold(i)
        return decisions

    def _forbidden(self, cons: ConstraintIndex, req: Request, c: Constraints, d: Demand):
        """The nodes ``c`` rules out among those that could ever take ``d``, and the unmet
        constraint when it rules out all of them."""
        if not c.filters:
            return frozenset(), None
        st = self.state
        fit = st.class_fit(d)
        cands = [i for i in range(len(st.ids)) if fit[st.ncls[i]] is not None]
        if not cands:
            return frozenset(), None
        return cons.forbidden(req.tenant, c, cands)

    @staticmethod
    def _narrowed_reason(c: Constraints | None, reason: tuple[Reason, str]) -> tuple[Reason, str]:
        if c is None:
            return reason
        if c.spread_key and not c.group:
            return Reason.SPREAD, f"{reason[1]}, spread over {c.spread_key} within max_skew {c.max_skew}"
        for name, on in (
            (Reason.SPREAD, c.spread_key and c.group),
            (Reason.ANTI_AFFINITY, c.anti_affinity),
            (Reason.AFFINITY, c.affinity),
            (Reason.NODE_SELECTOR, c.node_selector),
        ):
            if on:
                return name, f"{reason[1]} among the servers its {name.value} allows"
        return reason

    def _fits_held(self, held: list[int], d: Demand) -> bool:
        st = self.state
        fit = st.class_fit(d)
        return any(fit[st.ncls[i]] is not None and st.options(st._key(i), d) for i in held)

    def _place_on_held(self, held: list[int], d: Demand) -> Slot | None:
        st = self.state
        fit = st.class_fit(d)
        best = None
        for i in held:
            pen = fit[st.ncls[i]]
            if pen is None:
                continue
            key = st._key(i)
            opts = st.options(key, d)
            if not opts:
                continue
            score, _ = st.policy.choose(st, st.classes[key[0]], key, d, opts)
            cand = (pen, score, i)
            if best is None or cand < best:
                best = cand
        if best is None:
            return None
        return st.place_on(best[2], d)


def _versions_message(d: Demand, classes: list) -> str:
    """Which minimum no server of an acceptable model meets, and the newest there is."""

    def text(key: tuple[int, ...] | None) -> str:
        return ".".join(map(str, key)) if key else "none"

    parts = []
    for name, label in (("driver", "driver"), ("cuda", "CUDA"), ("rocm", "ROCm")):
        need = getattr(d.min_versions, name)
        if need is None:
            continue
        have = [v for c in classes if (v := getattr(c.software, name)) is not None]
        if not have or max(have) < need:
            parts.append(f"{label} >= {text(need)} (newest: {text(max(have) if have else None)})")
    what = "; ".join(parts) or "these driver, CUDA and ROCm versions together"
    return f"no server of an acceptable model has {what}"


def schedule(
    snapshot: Snapshot,
    pending: Sequence[Request],
    config: CycleConfig | None = None,
    workload: Distribution | None = None,
) -> list[Decision]:
    """Decide placements, preemptions and pending reasons for ``pending`` on ``snapshot``.

    The snapshot's nodes already account for the running workloads (GPU free milli, CPU and RAM used);
    ``snapshot.running`` lists them for fair share, backfill estimates and preemption. ``workload`` is
    the request mix that fragmentation is measured against (default: the pending queue itself).
    """
    engine = Engine(snapshot.nodes, snapshot.models, config, workload)
    return engine.cycle(pending, snapshot.running, snapshot.now, snapshot.tenant_weights)
