"""Choosing whom to preempt so that higher-priority work can start.

Only work of a strictly lower priority class is a candidate, and never a reservation owner's work on
its own reservation (lent capacity, by contrast, is reclaimed: spot work on a reserved node is lower
than the owner's reserved work). On a partly reserved node the owner preempts other work only for
its unused share; beyond it, only lent (spot, warm-pool) work. Victims are taken in the order: lowest class first (warm pool, then
spot, then on-demand), checkpointable jobs before the rest, least work lost (most recently started)
first. On each node that could host the request, victims are added in that order until it fits; the
node whose victim set is cheapest (highest victim class, then how many, then work lost) wins.

A gang (whole nodes, all or nothing) needs ``gpus / per-node`` whole nodes of one model in one region:
free ones cost nothing, and a busy node can be freed only if everything on it may be preempted. The
cheapest such set of nodes within one (model, region) group wins, or nothing is preempted at all.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from .spec import Demand
from .state import ClusterState, Slot, gpu_options
from .types import MILLI, Plan, Running

LENT_PLANS = (Plan.SPOT, Plan.WARM_POOL)


def is_protected(r: Running, reserved_for: str | None) -> bool:
    return r.plan == Plan.RESERVED and reserved_for is not None and reserved_for == r.tenant


def victim_order(r: Running, now: float) -> tuple:
    return (int(r.priority_class), 0 if r.checkpointable else 1, now - r.start_time, r.id)


def work_lost(r: Running, now: float) -> float:
    return 0.0 if r.checkpointable else max(0.0, now - r.start_time) * len(r.gpu_indices) * r.milli / MILLI


def _bundles(victim_sets: list[list[Running]]) -> list[list[int]]:
    """Group the positions of ``victim_sets`` that share a victim (by id), transitively."""
    parent = list(range(len(victim_sets)))

    def root(j: int) -> int:
        while parent[j] != j:
            parent[j] = parent[parent[j]]
            j = parent[j]
        return j

    first: dict[str, int] = {}
    for j, taken in enumerate(victim_sets):
        for v in taken:
            parent[root(j)] = root(first.setdefault(v.id, j))
    groups: dict[int, list[int]] = {}
    for j in range(len(victim_sets)):
        groups.setdefault(root(j), []).append(j)
    return list(groups.values())


@dataclass(frozen=True, slots=True)
class PreemptionChoice:
    nodes: tuple[int, ...]
    """Where the request goes (one node; a gang's whole nodes)."""
    victims: tuple[Running, ...]
    cost: tuple


class Preemptor:
    def __init__(
        self, state: ClusterState, running: list[Running], reserved_for: dict[str, str | None], now: float
    ):
        self.state = state
        self.now = now
        self.reserved_for = reserved_for
        self.by_node: dict[int, list[Running]] = {}
        self.gangs: dict[str, list[Running]] = {}
        self.gone: set[str] = set()
        for r in running:
            i = state.index.get(r.node_id)
            if i is None:
                continue
            self.by_node.setdefault(i, []).append(r)
            if r.gang_id:
                self.gangs.setdefault(r.gang_id, []).append(r)
        for lst in self.by_node.values():
            lst.sort(key=lambda r: victim_order(r, now))

    def slot_of(self, r: Running) -> Slot | None:
        i = self.state.index.get(r.node_id)
        if i is None:
            return None
        return self.state.slot_for(
            i, r.gpu_indices, r.milli, r.cpu_milli, r.memory_mib, r.mig_profile, r.mig_start
        )

    def _with_gang(self, r: Running) -> list[Running]:
        if r.gang_id and r.gang_id in self.gangs:
            return [m for m in self.gangs[r.gang_id] if m.id not in self.gone]
        return [r]

    def _candidates(self, lst: list[Running], priority: int) -> list[Running]:
        return [
            r
            for r in lst
            if r.id not in self.gone
            and int(r.priority_class) < priority
            and not is_protected(r, self.reserved_for.get(r.node_id))
        ]

    def _cost(self, pen: int, taken: list[Running]) -> tuple:
        return (
            pen,
            max(int(v.priority_class) for v in taken),
            len({v.id for v in taken}),
            sum(work_lost(v, self.now) for v in taken),
        )

    def _freeing(
        self, i: int, cands: list[Running]
    ) -> Iterator[tuple[list[int], list[int] | None, int, int, list[Running]]]:
        """Node ``i``'s free GPU milli, MIG states, CPU and RAM as ``cands`` (each with its whole gang)
        are preempted one after another, with the victims so far; yielded after each candidate."""
        state = self.state
        g = list(state.gfree[i])
        off = state.off[i]
        ms = None if state.mstate[i] is None else list(state.mstate[i])
        cpu, mem = state.cpu_free[i], state.mem_free[i]
        taken: list[Running] = []
        seen: set[str] = set()
        for r in cands:
            if r.id in seen:
                continue
            for m in self._with_gang(r):
                seen.add(m.id)
                taken.append(m)
                if m.node_id != r.node_id:
                    continue
                s = self.slot_of(m)
                if s is None:
                    continue
                for p in s.positions:
                    if p in off:
                        continue  # a GPU that takes no work: freeing it places nothing there
                    g[p] += s.milli
                    if s.mig and ms is not None and ms[p] >= 0:
                        ms[p] -= s.mig
                cpu += s.cpu
                mem += s.mem
            yield g, ms, cpu, mem, taken

    def find(
        self, demand: Demand, priority: int, avoid: frozenset[int] = frozenset()
    ) -> PreemptionChoice | None:
        if demand.gang:
            return self._find_gang(demand, priority, avoid)
        state = self.state
        fit = state.class_fit(demand)
        best: PreemptionChoice | None = None
        for i, lst in self.by_node.items():
            cls = state.classes[state.ncls[i]]
            pen = fit[cls.id]
            if pen is None or i in state.held or i in avoid:
                continue
            cands = self._candidates(lst, priority)
            j = state.keep_node.get(cls.id) if state.keep_node else None
            if j is not None and demand.access == cls.reserved_for and demand.gpus > state.keep[j]:
                # Beyond its unused share of a partly reserved node the owner takes back only lent
                # capacity: the rest of that node is not its reservation.
                cands = [r for r in cands if r.plan in LENT_PLANS]
            if not cands:
                continue
            for g, ms, cpu, mem, taken in self._freeing(i, cands):
                if cpu < demand.cpu or mem < demand.mem:
                    continue
                gk, mk = state.gkeys(i, g, ms)
                if state.keeping(cls.id, demand, gpu_options(cls, gk, demand, mk)):
                    cost = self._cost(pen, taken)
                    if best is None or cost < best.cost:
                        best = PreemptionChoice((i,), tuple(taken), cost)
                    break
        return best

    def _find_gang(self, demand: Demand, priority: int, avoid: frozenset[int]) -> PreemptionChoice | None:
        """Whole nodes for a gang: per (model, region) group, the free nodes and the nodes that can
        be emptied, cheapest first; the group whose ``need`` cheapest nodes cost least wins."""
        state = self.state
        fit = state.class_fit(demand)
        groups: dict[tuple[int, str, str], list[tuple[tuple, int, list[Running]]]] = {}

        def usable(i: int) -> tuple[int, str, str] | None:
            cls = state.classes[state.ncls[i]]
            pen = fit[cls.id]
            if pen is None or i in state.held or i in avoid or state.kept(cls.id, demand):
                return None
            if cls.cpu_cap < demand.cpu or cls.mem_cap < demand.mem or not cls.gpu_count:
                return None
            return (pen, cls.model, cls.region)

        for key, lst in state.buckets.items():
            if (
                key[4]
                or any(f != MILLI for island in key[3] for f in island)
                or key[1] < demand.cpu
                or key[2] < demand.mem
            ):
                continue
            for i in lst:
                if i in self.by_node:
                    continue
                g = usable(i)
                if g is not None:
                    groups.setdefault(g, []).append(((), i, []))
        for i, lst in self.by_node.items():
            grp = usable(i)
            if grp is None or i in state.held or state.mstate[i] is not None:
                continue  # (a node with GPUs in MIG mode never takes a gang)
            live = [r for r in lst if r.id not in self.gone]
            cands = self._candidates(live, priority)
            if len(cands) != len(live):
                continue  # something here may not be preempted: the node cannot be emptied
            last = deque(self._freeing(i, cands), maxlen=1)
            g, _ms, cpu, mem, taken = (
                last[0] if last else (state.gfree[i], None, state.cpu_free[i], state.mem_free[i], [])
            )
            if cpu < demand.cpu or mem < demand.mem or any(x != MILLI for x in g):
                continue  # an unhealthy GPU, or capacity the victims do not free
            cost = self._cost(grp[0], taken) if taken else ()
            groups.setdefault(grp, []).append((cost[1:], i, taken))
        best: PreemptionChoice | None = None
        for (pen, _model, _region), members in groups.items():
            per = state.classes[state.ncls[members[0][1]]].gpu_count
            need = demand.gpus // per
            if len(members) < need:
                continue
            # Nodes that share a victim (a gang's members) are freed together: one bundle, whose
            # cost is shared among its nodes. Cheapest per node first (free nodes cost nothing).
            ranked = []
            for js in _bundles([taken for _, _, taken in members]):
                vs = {(v.id, v.node_id): v for j in js for v in members[j][2]}
                n = len(js)
                if vs:
                    c = self._cost(0, list(vs.values()))
                    rank: tuple = (c[1], c[2] / n, c[3] / n)
                else:
                    rank = ()
                ranked.append((rank, min(members[j][1] for j in js), js, list(vs.values())))
            ranked.sort(key=lambda b: (b[0], b[1]))
            chosen: list[int] = []
            victims: list[Running] = []
            for _, _, js, vs in ranked:
                if len(chosen) >= need:
                    break
                chosen.extend(sorted(members[j][1] for j in js)[: need - len(chosen)])
                victims.extend(vs)
            if not victims:
                continue  # room without preemption: placement would have found it
            choice = PreemptionChoice(tuple(chosen), tuple(victims), self._cost(pen, victims))
            if best is None or choice.cost < best.cost:
                best = choice
        return best

    def apply(self, choice: PreemptionChoice, demand: Demand) -> list[Slot]:
        released: set[tuple[str, str]] = set()
        for v in choice.victims:  # gang members included
            self.gone.add(v.id)
            if (v.id, v.node_id) in released:
                continue
            released.add((v.id, v.node_id))
            s = self.slot_of(v)
            if s is not None:
                self.state.release(s)
        if demand.gang:
            return [self.state.take_whole(i, demand) for i in choice.nodes]
        slot = self.state.place_on(choice.nodes[0], demand)
        if slot is None:
            raise AssertionError("preemption freed too little")
        return [slot]
