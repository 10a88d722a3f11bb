"""Elastic jobs: running work that may hold between ``elastic_min`` and ``elastic_max`` whole GPUs of
its node.

What an elastic job holds above its minimum is idle capacity it borrows: it must never keep anyone
waiting, nor change where anyone goes. So the cycle (``Engine.cycle``; the live scheduler and the
simulator take the same decisions) works in three steps:

- **Lend.** Before the queue is tried, every elastic job's GPUs above its minimum are given back to
  the placement index, and the job counts for fair share, backfill and preemption as holding its
  minimum. Placement, backfill and the head-of-queue reservation then see exactly what they would
  see with no elastic job grown, whatever their class (a reservation owner's work on its own
  reservation is the exception: its borrowed GPUs stay its own, and are taken only for the owner,
  by ``shrink_for``, before anyone is preempted).
- **Claim.** A placement that lands on borrowed GPUs shrinks their holder (a ``Resize`` just before
  the ``Place``). On its node, it takes truly idle GPUs of the same NVLink island first, then the
  borrowed GPUs of the lowest class and most recently started job first.
- **Return, then grow.** Once the queue is served, borrowed GPUs nobody took go back to their jobs
  (no decision: nothing changed), and each elastic job below its maximum takes the whole free GPUs
  of its node (highest class, then oldest first), except on nodes held for the head of the queue
  and on nodes reserved for another tenant.

An elastic job never spans nodes, so a resize is a change of GPU indices on one node. GPUs at or
below the minimum are protected as any running work is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .preemption import is_protected
from .spec import Demand
from .state import ClusterState, Slot
from .types import MILLI, Node, NodeState, Resize, Running


def _shrink_order(r: Running) -> tuple:
    return (int(r.priority_class), -r.start_time, r.id)


class Elastic:
    """The elastic jobs of one cycle, by node index. ``running`` objects are updated in place as
    they resize (their ``gpu_indices``), so the preemptor that shares them sees what they hold;
    between ``lend`` and ``give_back`` a lending job's ``gpu_indices`` are its firm GPUs only."""

    def __init__(self, state: ClusterState, nodes: Sequence[Node], running: Sequence[Running]) -> None:
        self.state = state
        self.ready = {n.id for n in nodes if n.state == NodeState.READY}
        self.reserved_for = {n.id: n.reserved_for for n in nodes}
        self.by_node: dict[int, list[Running]] = {}
        for r in running:
            if r.elastic_max <= 0 or r.milli != MILLI:
                continue
            i = state.index.get(r.node_id)
            if i is not None:
                self.by_node.setdefault(i, []).append(r)
        self.lent: dict[str, list[int]] = {}
        """Per lending job, the GPU indices it borrows that nobody has taken yet."""
        self.owner: dict[tuple[int, int], Running] = {}
        """(node index, position) of each lent GPU -> the job that lends it."""
        self.gone: set[str] = set()
        """Jobs preempted in this cycle: neither given back their GPUs nor grown."""

    def __bool__(self) -> bool:
        return bool(self.by_node)

    def _positions(self, i: int, r: Running) -> list[int]:
        idx = self.state.gpu_index[i]
        return [idx.index(g) for g in r.gpu_indices if g in idx]

    def lend(self) -> None:
        """Give every unprotected elastic job's GPUs above its minimum back to the index."""
        st = self.state
        for i, jobs in self.by_node.items():
            node_id = st.ids[i]
            if node_id not in self.ready:
                continue
            owner = self.reserved_for.get(node_id)
            idx = st.gpu_index[i]
            for r in jobs:
                keep = max(1, r.elastic_min)
                if len(r.gpu_indices) <= keep or is_protected(r, owner):
                    continue
                # A GPU that takes no work (draining for a MIG change) stays with its job, unlent:
                # such GPUs count first toward the job's minimum.
                off = st.off[i]
                held = sorted(r.gpu_indices, key=lambda g: (not (g in idx and idx.index(g) in off), g))
                firm, rest = held[:keep], held[keep:]
                lent = [g for g in rest if g in idx and idx.index(g) not in off]
                firm = sorted(firm + [g for g in rest if g in idx and idx.index(g) in off])
                for g in lent:
                    p = idx.index(g)
                    st.release(Slot(i, (p,), MILLI, 0, 0))
                    self.owner[(i, p)] = r
                r.gpu_indices = tuple(firm)
                self.lent[r.id] = lent

    def _rank(self, i: int, p: int) -> tuple:
        """Which free whole GPU of node ``i`` a placement should take first (lowest)."""
        r = self.owner.get((i, p))
        return (0,) if r is None or r.id in self.gone else (1, *_shrink_order(r))

    def claim(
        self, slots: Sequence[Slot], request_id: str, victims: Sequence[str] = ()
    ) -> tuple[list[Slot], list[Resize]]:
        """The slots of a placement just made, moved off borrowed GPUs where an idle GPU of the same
        island (or a GPU borrowed by a job first in shrink order) will do, and the resizes of the
        jobs whose borrowed GPUs it still takes."""
        self.gone.update(victims)
        if not self.owner:
            return list(slots), []
        st = self.state
        out_slots: list[Slot] = []
        taken: dict[str, tuple[Running, list[int]]] = {}
        for s in slots:
            i = s.node
            if s.mig or not any((i, p) in self.owner for p in s.positions):
                out_slots.append(s)
                continue
            g = st.gfree[i]
            ms = st.mstate[i]
            islands = st.classes[st.ncls[i]].islands
            positions = list(s.positions)
            for k, p in enumerate(positions):
                if (i, p) not in self.owner:
                    continue
                island = next(isl for isl in islands if p in isl)
                best = min(
                    (q for q in island if g[q] == MILLI and (ms is None or ms[q] < 0) and q not in positions),
                    key=lambda q: self._rank(i, q),
                    default=None,
                )
                if best is not None and self._rank(i, best) < self._rank(i, p):
                    st.release(Slot(i, (p,), s.milli, 0, 0))
                    st.allocate(Slot(i, (best,), s.milli, 0, 0))
                    positions[k] = p = best
                r = self.owner.pop((i, p), None)
                if r is None or r.id in self.gone:
                    continue
                gi = st.gpu_index[i][p]
                self.lent[r.id].remove(gi)
                taken.setdefault(r.id, (r, []))[1].append(gi)
            out_slots.append(replace(s, positions=tuple(positions)))
        resizes = [
            Resize(
                r.id,
                r.node_id,
                tuple(sorted(r.gpu_indices + tuple(self.lent[r.id]))),
                removed=tuple(sorted(removed)),
                for_request=request_id,
            )
            for r, removed in taken.values()
        ]
        return out_slots, resizes

    def give_back(self) -> None:
        """Return the borrowed GPUs nobody took to their jobs (their holders do not change)."""
        st = self.state
        for (i, p), r in self.owner.items():
            if r.id in self.gone:
                continue
            if st.gfree[i][p] != MILLI:
                raise AssertionError("a lent GPU was taken without a claim")
            st.allocate(Slot(i, (p,), MILLI, 0, 0))
        for jobs in self.by_node.values():
            for r in jobs:
                lent = self.lent.get(r.id)
                if lent:
                    r.gpu_indices = tuple(sorted(r.gpu_indices + tuple(lent)))
        self.owner.clear()
        self.lent.clear()

    def shrink_for(
        self, d: Demand, priority: int, tenant: str, request_id: str, avoid: frozenset[int]
    ) -> tuple[Slot, list[Resize]] | None:
        """Make room for ``d`` (one node, whole or shared GPUs) by shrinking elastic jobs that did
        not lend their GPUs (a reservation owner's work on its own reservation, for the owner) on
        one node; returns its slot and the resizes (already applied to the state), or None."""
        if d.gang or d.per_node:
            return None
        st = self.state
        fit = st.class_fit(d)
        for i, jobs in self.by_node.items():
            if i in avoid or i in st.held or fit[st.ncls[i]] is None:
                continue
            node_id = st.ids[i]
            if node_id not in self.ready:
                continue
            cands = sorted(
                (
                    r
                    for r in jobs
                    if len(r.gpu_indices) > r.elastic_min
                    and r.id not in self.gone
                    and (r.tenant == tenant or not is_protected(r, self.reserved_for.get(node_id)))
                ),
                key=_shrink_order,
            )
            taken: list[tuple[Running, int]] = []
            slot = None
            for r in cands:
                # GPUs that take work go first (a draining GPU freed would place nothing).
                positions = sorted(self._positions(i, r), key=lambda p: p not in st.off[i])
                while len(positions) > r.elastic_min and len(positions) > 1:
                    p = positions.pop()
                    st.release(Slot(i, (p,), MILLI, 0, 0))
                    taken.append((r, p))
                    slot = st.place_on(i, d)
                    if slot is not None:
                        break
                if slot is not None:
                    break
            if slot is None:
                for _r, p in taken:
                    st.allocate(Slot(i, (p,), MILLI, 0, 0))
                continue
            return slot, self._commit(i, taken, request_id)
        return None

    def _commit(self, i: int, taken: list[tuple[Running, int]], request_id: str) -> list[Resize]:
        idx = self.state.gpu_index[i]
        out: list[Resize] = []
        by_job: dict[str, tuple[Running, list[int]]] = {}
        for r, p in taken:
            by_job.setdefault(r.id, (r, []))[1].append(idx[p])
        for r, removed in by_job.values():
            r.gpu_indices = tuple(g for g in r.gpu_indices if g not in removed)
            out.append(
                Resize(r.id, r.node_id, r.gpu_indices, removed=tuple(sorted(removed)), for_request=request_id)
            )
        return out

    def grow(self) -> list[Resize]:
        """Give idle whole GPUs to elastic jobs below their maximum, on their own nodes."""
        st = self.state
        out: list[Resize] = []
        for i, jobs in self.by_node.items():
            node_id = st.ids[i]
            if i in st.held or node_id not in self.ready:
                continue
            owner = self.reserved_for.get(node_id)
            g = st.gfree[i]
            ms = st.mstate[i]
            for r in sorted(jobs, key=lambda r: (-int(r.priority_class), r.start_time, r.id)):
                if r.id in self.gone or (owner is not None and owner != r.tenant):
                    continue
                want = r.elastic_max - len(r.gpu_indices)
                if want <= 0:
                    continue
                # Whole idle GPUs, never one in MIG mode (MIG work only goes there).
                free = [p for p, x in enumerate(g) if x == MILLI and (ms is None or ms[p] < 0)][:want]
                if not free:
                    break
                st.allocate(Slot(i, tuple(free), MILLI, 0, 0))
                idx = st.gpu_index[i]
                added = tuple(idx[p] for p in free)
                r.gpu_indices = tuple(sorted(r.gpu_indices + added))
                out.append(Resize(r.id, r.node_id, r.gpu_indices, added=tuple(sorted(added))))
        return out
