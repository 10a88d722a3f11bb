"""Choosing whom to preempt so that higher-priority work can start.

Only work of a strictly lower priority class is a candidate, and never a reservation owner's work on
its own reservation (lent capacity, by contrast, is reclaimed: spot work on a reserved node is lower
than the owner's reserved work). Victims are taken in the order: lowest class first (warm pool, then
spot, then on-demand), checkpointable jobs before the rest, least work lost (most recently started)
first. On each node that could host the request, victims are added in that order until it fits; the
node whose victim set is cheapest (highest victim class, then how many, then work lost) wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import Demand
from .state import ClusterState, Slot, gpu_options
from .types import MILLI, Plan, Running


def is_protected(r: Running, reserved_for: str | None) -> bool:
    return r.plan == Plan.RESERVED and reserved_for is not None and reserved_for == r.tenant


def victim_order(r: Running, now: float) -> tuple:
    return (int(r.priority_class), 0 if r.checkpointable else 1, now - r.start_time, r.id)


def work_lost(r: Running, now: float) -> float:
    return 0.0 if r.checkpointable else max(0.0, now - r.start_time) * len(r.gpu_indices) * r.milli / MILLI


@dataclass(frozen=True, slots=True)
class PreemptionChoice:
    node: int
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
        idx = self.state.gpu_index[i]
        positions = tuple(idx.index(g) for g in r.gpu_indices if g in idx)
        return Slot(i, positions, r.milli, r.cpu_milli, r.memory_mib)

    def _with_gang(self, r: Running) -> list[Running]:
        if r.gang_id and r.gang_id in self.gangs:
            return [m for m in self.gangs[r.gang_id] if m.id not in self.gone]
        return [r]

    def find(self, demand: Demand, priority: int) -> PreemptionChoice | None:
        if demand.gang:
            return None
        state = self.state
        fit = state.class_fit(demand)
        best: PreemptionChoice | None = None
        for i, lst in self.by_node.items():
            cls = state.classes[state.ncls[i]]
            pen = fit[cls.id]
            if pen is None or i in state.held:
                continue
            cands = [
                r
                for r in lst
                if r.id not in self.gone
                and int(r.priority_class) < priority
                and not is_protected(r, self.reserved_for.get(r.node_id))
            ]
            if not cands:
                continue
            g = list(state.gfree[i])
            cpu = state.cpu_free[i]
            mem = state.mem_free[i]
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
                        g[p] += s.milli
                    cpu += s.cpu
                    mem += s.mem
                if cpu < demand.cpu or mem < demand.mem:
                    continue
                gk = tuple(tuple(sorted((g[p] for p in isl), reverse=True)) for isl in cls.islands)
                if gpu_options(cls, gk, demand, state.mig_key(i, g)):
                    cost = (
                        pen,
                        max(int(v.priority_class) for v in taken),
                        len(taken),
                        sum(work_lost(v, self.now) for v in taken),
                    )
                    if best is None or cost < best.cost:
                        best = PreemptionChoice(i, tuple(taken), cost)
                    break
        return best

    def apply(self, choice: PreemptionChoice, demand: Demand) -> Slot:
        for v in choice.victims:
            self.gone.add(v.id)
            s = self.slot_of(v)
            if s is not None:
                self.state.release(s)
        slot = self.state.place_on(choice.node, demand)
        if slot is None:
            raise AssertionError("preemption freed too little")
        return slot
