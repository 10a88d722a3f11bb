"""Elastic jobs: running work that may hold between ``elastic_min`` and ``elastic_max`` whole GPUs of
its node.

Two moves, both made by the cycle (``Engine.cycle``), so the live scheduler and the simulator take
the same decisions:

- **Shrink before preempting.** A request that does not fit is first offered the GPUs elastic jobs
  hold above their minimum, on one node, whatever their class: what an elastic job holds above its
  minimum is idle capacity it borrows, and must not keep anyone waiting (a reservation owner's work
  on its own reservation is only shrunk for the owner). GPUs are taken one at a time, lowest class
  and most recently started job first, until the request fits; if it never fits there, nothing
  changes on that node. Only when no node can be made to fit this way does preemption run; GPUs at
  or below the minimum are protected as any running work is.
- **Grow into idle GPUs.** After the queue is served, each elastic job below its maximum takes the
  whole free GPUs of its node (highest class, then oldest first), except on nodes held for the head
  of the queue and on nodes reserved for another tenant.

An elastic job never spans nodes, so a resize is a change of GPU indices on one node.
"""

from __future__ import annotations

from collections.abc import Sequence

from .preemption import is_protected
from .spec import Demand
from .state import ClusterState, Slot
from .types import MILLI, Node, NodeState, Resize, Running


def _shrink_order(r: Running) -> tuple:
    return (int(r.priority_class), -r.start_time, r.id)


class Elastic:
    """The elastic jobs of one cycle, by node index. ``running`` objects are updated in place as
    they resize (their ``gpu_indices``), so the preemptor that shares them sees what they hold."""

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

    def __bool__(self) -> bool:
        return bool(self.by_node)

    def _positions(self, i: int, r: Running) -> list[int]:
        idx = self.state.gpu_index[i]
        return [idx.index(g) for g in r.gpu_indices if g in idx]

    def shrink_for(
        self, d: Demand, priority: int, tenant: str, request_id: str, avoid: frozenset[int]
    ) -> tuple[Slot, list[Resize]] | None:
        """Make room for ``d`` (one node, whole or shared GPUs) by shrinking elastic jobs on one
        node; returns its slot and the resizes (already applied to the state), or None."""
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
                    and (r.tenant == tenant or not is_protected(r, self.reserved_for.get(node_id)))
                ),
                key=_shrink_order,
            )
            taken: list[tuple[Running, int]] = []
            slot = None
            for r in cands:
                positions = self._positions(i, r)
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
                if owner is not None and owner != r.tenant:
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
