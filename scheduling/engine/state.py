"""The mutable placement index over a snapshot.

Nodes in identical states (same hardware class, same free CPU and RAM, same free capacity per GPU
within each NVLink island) are kept in one *bucket*, because identical nodes score identically: a
policy scores a bucket once per demand, not every node. For every demand in use there is a heap of
(score, bucket) entries; a placement moves one node from its bucket to another, so the only new work
after a placement is to score buckets that did not exist before (they are appended to a log that each
demand's heap catches up with lazily). Emptied buckets are dropped from a heap when they reach its top.
The cost of a decision therefore depends on the number of distinct states, not on the number of nodes.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from . import mig as M
from .spec import ACCESS_LEND, ACCESS_NONE, Demand
from .types import MILLI, NO_VERSIONS, GpuModelInfo, Node, NodeState, SoftwareVersions

if TYPE_CHECKING:
    from .policies import Policy

GKey = tuple[tuple[int, ...], ...]
Key = tuple[int, int, int, GKey, GKey]
"""(class id, free CPU, free RAM, free capacity units per GPU not in MIG mode by island, the MIG
states (``mig.py``) of the GPUs in MIG mode by island: empty when the node has none)."""
Picks = tuple[tuple[int, ...], ...]
"""The GPUs a placement takes on a node, as (island, free milli before) pairs; for a MIG instance
(island, free milli before, MIG state before)."""
Option = tuple[int, Picks, GKey]
"""(topology penalty, picks, GPU key after the placement)."""
PREFER_SPAN = 1 << 16
_NONE_OFF: frozenset[int] = frozenset()
"""A region penalty outweighs any model rank of a preference."""


@dataclass(frozen=True, slots=True)
class NodeClass:
    id: int
    model: str
    region: str
    gpu_count: int
    cpu_cap: int
    mem_cap: int
    islands: tuple[tuple[int, ...], ...]
    """Positions (into the node's GPU list) of the GPUs of each island."""
    reserved_for: str | None
    oversub: int = MILLI
    """The model's over-subscription factor in thousandths (1000: none)."""
    software: SoftwareVersions = NO_VERSIONS
    """The nodes' driver, CUDA and ROCm versions (nodes that differ are classes of their own)."""


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one node's share of a placement went."""

    node: int
    positions: tuple[int, ...]
    milli: int
    cpu: int
    mem: int
    mig: int = 0
    """A MIG instance's use of its GPU's MIG state (``mig.py``); 0 for other work."""
    mig_start: int = -1
    """The memory slice the MIG instance starts at (-1: not a MIG instance)."""


class _Heap:
    __slots__ = ("cursor", "entries", "fit", "members", "scores")

    def __init__(self, fit: list[int | None], cursor: int, scores: dict[int, tuple | None]) -> None:
        self.entries: list[tuple] = []
        self.members: set[int] = set()
        self.fit = fit
        self.cursor = cursor
        self.scores = scores
        """Policy score per state id, shared by demands that differ only in region or plan."""


def share_units(cls: NodeClass, demand: Demand) -> int:
    """Capacity units (of a GPU's 1000) that one GPU of a node of ``cls`` gives ``demand``: a
    fractional, non-MIG share on an over-subscribed model takes ``ceil(milli / factor)``; whole GPUs
    and MIG slices take their milli."""
    milli = demand.milli
    if milli >= MILLI or demand.mig or cls.oversub == MILLI:
        return milli
    return -(-milli * MILLI // cls.oversub)


def _mig_options(cls: NodeClass, gkey: GKey, demand: Demand, mig: GKey) -> list[Option]:
    """The GPUs in MIG mode (states per island in ``mig``) on which the hardware can make an instance
    of ``demand``'s profile; the GPU key of the other GPUs does not change."""
    out: list[Option] = []
    for ii, island in enumerate(mig):
        last = -1
        for state in island:
            if state == last:
                continue
            last = state
            if M.place(cls.model, state, demand.mig) is not None:
                out.append((0, ((ii, M.free_milli(cls.model, state), state),), gkey))
    return out


def gpu_options(cls: NodeClass, gkey: GKey, demand: Demand, mig: GKey = ()) -> list[Option]:
    """Every distinct way to take ``demand``'s GPUs from a node whose GPUs not in MIG mode are
    ``gkey`` (free capacity units per island) and whose GPUs in MIG mode are ``mig`` (MIG states per
    island; empty when none): a MIG instance only goes to a GPU in MIG mode where the hardware can
    make it, other work only to the other GPUs."""
    if demand.gpus == 0:
        return [(0, (), gkey)]
    if demand.mig:
        return _mig_options(cls, gkey, demand, mig) if mig else []
    milli = demand.milli
    if milli < MILLI:
        milli = share_units(cls, demand)
        out = []
        for ii, island in enumerate(gkey):
            last = -1
            for pos, free in enumerate(island):
                if free < milli:
                    break
                if free == last:
                    continue
                last = free
                new_island = tuple(sorted((*island[:pos], free - milli, *island[pos + 1 :]), reverse=True))
                out.append((0, ((ii, free),), (*gkey[:ii], new_island, *gkey[ii + 1 :])))
        return out
    need = demand.gpus
    fulls = [island.count(MILLI) for island in gkey]
    if sum(fulls) < need:
        return []
    out = []
    for ii, n in enumerate(fulls):
        if n >= need:
            island = gkey[ii]
            new_island = (*island[n:], *([0] * need))
            new_island = tuple(sorted((*island[: n - need], *new_island), reverse=True))
            out.append((0, ((ii, MILLI),) * need, (*gkey[:ii], new_island, *gkey[ii + 1 :])))
    if out:
        return out
    # Spread across the fewest islands: take from the islands with the most whole GPUs first.
    order = sorted(range(len(gkey)), key=lambda j: -fulls[j])
    picks: list[tuple[int, int]] = []
    new = list(gkey)
    left = need
    used = 0
    for ii in order:
        take = min(left, fulls[ii])
        if take <= 0:
            continue
        used += 1
        picks.extend([(ii, MILLI)] * take)
        island = gkey[ii]
        new[ii] = tuple(sorted((*island[take:], *([0] * take)), reverse=True))
        left -= take
        if left == 0:
            break
    return [(used - 1, tuple(picks), tuple(new))]


class ClusterState:
    """Free capacity of every READY node, indexed by state, with placement by a policy."""

    def __init__(
        self,
        nodes: Iterable[Node],
        catalog: dict[str, GpuModelInfo] | None = None,
        policy: Policy | None = None,
        seed: int = 0,
    ) -> None:
        from .policies import get_policy

        self.catalog = catalog or {}
        self.policy = policy if policy is not None else get_policy("gpupool")
        self.rng = random.Random(seed)
        self.classes: list[NodeClass] = []
        class_ids: dict[tuple, int] = {}
        self.ids: list[str] = []
        self.index: dict[str, int] = {}
        self.ncls: list[int] = []
        self.cpu_free: list[int] = []
        self.mem_free: list[int] = []
        self.gfree: list[list[int]] = []
        self.off: list[frozenset[int]] = []
        """Per node, the positions of GPUs that take no work (unhealthy, isolated, draining for a MIG
        change): free 0 whatever ends on them, so no release, lend or estimate gives them capacity."""
        self.gpu_index: list[tuple[int, ...]] = []
        self.domain: list[str] = []
        self.keys: list[Key | None] = []
        self.pos: list[int] = []
        self.buckets: dict[Key, list[int]] = {}
        # Every state ever seen gets a small integer id, so that the hot paths (heap catch-up and
        # top-of-heap checks) hash ints instead of nested tuples.
        self._kid: dict[Key, int] = {}
        self._kkey: list[Key] = []
        self._kbucket: list[list[int] | None] = []
        self.log: list[int] = []
        self.held: set[int] = set()
        self._heaps: dict[Demand, _Heap] = {}
        self._scores: dict[tuple, dict[int, tuple | None]] = {}
        self._fits: dict[Demand, list[int | None]] = {}
        self.capacity_milli = 0
        self._max_spec: tuple[int, int] | None = None
        self.mstate: list[list[int] | None] = []
        """Per node: the MIG state (``mig.py``) of each GPU in MIG mode, -1 for the others (None when
        no GPU of the node is in MIG mode)."""
        # A partly reserved node is a class of its own: class id -> node, and per node the whole
        # GPUs that must stay free (or lent) for the owner's unused reserved share.
        self.keep_node: dict[int, int] = {}
        self.keep: dict[int, int] = {}
        for node in nodes:
            self._add_node(node, class_ids)

    # -- building -------------------------------------------------------------------------------

    def _add_node(self, node: Node, class_ids: dict[tuple, int]) -> None:
        islands: dict[int, list[int]] = {}
        for p, g in enumerate(node.gpus):
            islands.setdefault(g.island, []).append(p)
        isl = tuple(tuple(v) for _, v in sorted(islands.items())) or ((),)
        sig = (
            node.model,
            node.region,
            len(node.gpus),
            node.cpu_milli,
            node.memory_mib,
            isl,
            node.reserved_for,
            self._oversub(node.model),
            node.software,
        )
        partial = node.reserved_for is not None and node.reserved_gpus is not None
        cid = None if partial else class_ids.get(sig)
        if cid is None:
            cid = len(self.classes)
            if not partial:
                class_ids[sig] = cid
            self.classes.append(NodeClass(cid, *sig))
        i = len(self.ids)
        if partial:
            self.keep_node[cid] = i
            self.keep[i] = max(0, node.reserved_gpus or 0)
        self.ids.append(node.id)
        self.index[node.id] = i
        self.ncls.append(cid)
        self.cpu_free.append(node.cpu_milli - node.cpu_used)
        self.mem_free.append(node.memory_mib - node.memory_used)
        self.gfree.append([g.free_milli if g.healthy else 0 for g in node.gpus])
        off = frozenset(p for p, g in enumerate(node.gpus) if not g.healthy)
        self.off.append(off or _NONE_OFF)
        states = [
            M.state_of(node.model, g.mig_layout, g.mig_used) if g.mig and g.healthy else -1 for g in node.gpus
        ]
        self.mstate.append(states if any(st >= 0 for st in states) else None)
        self.gpu_index.append(tuple(g.index for g in node.gpus))
        self.domain.append(node.domain)
        self.keys.append(None)
        self.pos.append(-1)
        if node.state == NodeState.READY:
            self.capacity_milli += MILLI * sum(1 for g in node.gpus if g.healthy)
            self._enter(i)

    def _oversub(self, model: str) -> int:
        info = self.catalog.get(model)
        return MILLI if info is None else max(MILLI, round(info.oversubscription * MILLI))

    def _key(self, i: int) -> Key:
        cls = self.classes[self.ncls[i]]
        gk, mk = self.gkeys(i, self.gfree[i], self.mstate[i])
        return (cls.id, self.cpu_free[i], self.mem_free[i], gk, mk)

    def gkeys(self, i: int, g: list[int], ms: list[int] | None) -> tuple[GKey, GKey]:
        """The GPU key (free units per island of the GPUs not in MIG mode) and the MIG key (states per
        island of the GPUs in MIG mode; empty when none) of node ``i`` if its GPUs had the free units
        ``g`` and the MIG states ``ms``."""
        cls = self.classes[self.ncls[i]]
        if ms is None:
            if len(cls.islands) == 1:
                return (tuple(sorted(g, reverse=True)),), ()
            return tuple(tuple(sorted((g[p] for p in isl), reverse=True)) for isl in cls.islands), ()
        gk = tuple(tuple(sorted((g[p] for p in isl if ms[p] < 0), reverse=True)) for isl in cls.islands)
        mk = tuple(tuple(sorted((ms[p] for p in isl if ms[p] >= 0), reverse=True)) for isl in cls.islands)
        return gk, mk

    def slot_for(
        self,
        i: int,
        gpu_indices: Iterable[int],
        milli: int,
        cpu: int,
        mem: int,
        mig_profile: str | None = None,
        mig_start: int | None = None,
    ) -> Slot:
        """The slot of work already placed on node ``i`` (its GPUs by index)."""
        idx = self.gpu_index[i]
        positions = tuple(idx.index(g) for g in gpu_indices if g in idx)
        if mig_profile and mig_start is not None and mig_start >= 0:
            use = M.use_of(self.classes[self.ncls[i]].model, mig_profile, mig_start)
            return Slot(i, positions, milli, cpu, mem, use, mig_start)
        return Slot(i, positions, milli, cpu, mem)

    def _enter(self, i: int) -> None:
        key = self._key(i)
        self.keys[i] = key
        kid = self._kid.get(key)
        if kid is None:
            kid = self._kid[key] = len(self._kkey)
            self._kkey.append(key)
            self._kbucket.append(None)
        lst = self._kbucket[kid]
        if lst is None:
            self.buckets[key] = self._kbucket[kid] = lst = []
            self.log.append(kid)
        self.pos[i] = len(lst)
        lst.append(i)

    def _leave(self, i: int) -> None:
        key = self.keys[i]
        if key is None:
            return
        lst = self.buckets[key]
        p = self.pos[i]
        last = lst.pop()
        if last != i:
            lst[p] = last
            self.pos[last] = p
        if not lst:
            del self.buckets[key]
            self._kbucket[self._kid[key]] = None
        self.keys[i] = None
        self.pos[i] = -1

    # -- queries -----------------------------------------------------------------------------------

    def class_fit(self, demand: Demand) -> list[int | None]:
        """Per node class: None where the class can never take ``demand``, else its region penalty."""
        fit = self._fits.get(demand)
        if fit is not None:
            return fit
        fit = []
        for cls in self.classes:
            fit.append(self._class_penalty(cls, demand))
        self._fits[demand] = fit
        return fit

    def _class_penalty(self, cls: NodeClass, demand: Demand) -> int | None:
        if demand.gpus and cls.model not in demand.models:
            return None
        if demand.excluded and (cls.model, cls.region) in demand.excluded:
            return None
        if demand.min_versions and not cls.software.meets(demand.min_versions):
            return None
        if cls.reserved_for is None:
            if demand.access not in ("", ACCESS_LEND):
                return None
        elif demand.access not in (ACCESS_LEND, cls.reserved_for) and not (
            demand.access == ACCESS_NONE and cls.id in self.keep_node
        ):
            return None
        if demand.gang:
            if cls.gpu_count == 0 or demand.gpus % cls.gpu_count:
                return None
        elif demand.gpus > cls.gpu_count and not (demand.per_node and demand.per_node[-1] <= cls.gpu_count):
            return None
        if demand.cpu > cls.cpu_cap or demand.mem > cls.mem_cap:
            return None
        if demand.region is None or demand.region == cls.region:
            pen = 0
        elif demand.other_regions_ok:
            pen = 1
        else:
            return None
        if demand.prefer:
            # The region first, then the model's rank for the request's preference.
            rank = demand.prefer.index(cls.model) if cls.model in demand.prefer else len(demand.prefer)
            pen = pen * PREFER_SPAN + rank
        return pen

    def options(self, key: Key, demand: Demand) -> list[Option]:
        if key[1] < demand.cpu or key[2] < demand.mem:
            return []
        return self.keeping(key[0], demand, gpu_options(self.classes[key[0]], key[3], demand, key[4]))

    def kept(self, cid: int, demand: Demand) -> int:
        """Whole GPUs ``demand`` must leave free on a node of class ``cid`` (a partly reserved
        node keeps its owner's unused share from on-demand work)."""
        if demand.access != ACCESS_NONE or not self.keep_node:
            return 0
        i = self.keep_node.get(cid)
        return 0 if i is None else self.keep[i]

    def keeping(self, cid: int, demand: Demand, opts: list[Option]) -> list[Option]:
        k = self.kept(cid, demand)
        if k <= 0:
            return opts
        return [o for o in opts if sum(isl.count(MILLI) for isl in o[2]) >= k]

    def max_spec(self) -> tuple[int, int]:
        """The largest server's CPU and GPU capacity (milli), for normalizing scores."""
        if self._max_spec is None:
            self._max_spec = (
                max((c.cpu_cap for c in self.classes), default=1) or 1,
                max((c.gpu_count * MILLI for c in self.classes), default=1) or 1,
            )
        return self._max_spec

    def node_count(self) -> int:
        return len(self.ids)

    # -- placement ---------------------------------------------------------------------------------

    def _heap(self, demand: Demand) -> _Heap:
        h = self._heaps.get(demand)
        if h is None:
            shape = (demand.models, demand.milli, demand.gpus, demand.cpu, demand.mem, demand.mig)
            scores = self._scores.get(shape)
            if scores is None:
                scores = self._scores[shape] = {}
            h = _Heap(self.class_fit(demand), len(self.log), scores)
            self._heaps[demand] = h
            for key in self.buckets:
                self._push(h, self._kid[key], demand)
            heapq.heapify(h.entries)
        elif h.cursor < len(self.log):
            kbucket = self._kbucket
            members = h.members
            for kid in self.log[h.cursor :]:
                if kbucket[kid] is not None and kid not in members:
                    entry = self._entry(h, kid, demand)
                    if entry is not None:
                        heapq.heappush(h.entries, entry)
                        members.add(kid)
            h.cursor = len(self.log)
        return h

    def _push(self, h: _Heap, kid: int, demand: Demand) -> None:
        entry = self._entry(h, kid, demand)
        if entry is not None:
            h.entries.append(entry)
            h.members.add(kid)

    def _entry(self, h: _Heap, kid: int, demand: Demand) -> tuple | None:
        key = self._kkey[kid]
        pen = h.fit[key[0]]
        if pen is None:
            return None
        scores = h.scores
        # A partly reserved node's options depend on the demand's access: never shared.
        own = bool(self.keep_node) and key[0] in self.keep_node
        if kid in scores and not own:
            sc = scores[kid]
        else:
            sc = None
            if key[1] >= demand.cpu and key[2] >= demand.mem:
                cls = self.classes[key[0]]
                opts = gpu_options(cls, key[3], demand, key[4])
                if own:
                    opts = self.keeping(key[0], demand, opts)
                if opts:
                    score, opt = self.policy.choose(self, cls, key, demand, opts)
                    sc = (opt[0], score, opt[1])
            if not own:
                scores[kid] = sc
        if sc is None:
            return None
        return (pen, sc[0], sc[1], self.rng.random(), kid, sc[2])

    def invalidate(self) -> None:
        """Forget every score (call when the policy's view of the workload changes)."""
        self._heaps.clear()
        self._scores.clear()

    def place(self, demand: Demand, avoid: frozenset[int] = frozenset(), pick=None) -> list[Slot] | None:
        """Place ``demand`` by the policy, update the index, and return where it went (or None).
        Nodes in ``avoid`` (indices) are not chosen. ``pick(members, need)`` chooses a gang's nodes
        among a group's free ones (a spread), or returns None; default: the first by id."""
        if demand.gang:
            return self._place_gang(demand, avoid, pick)
        if self.policy.scan:
            return self._place_scan(demand, avoid)
        h = self._heap(demand)
        entries = h.entries
        kbucket = self._kbucket
        skipped: list[tuple] = []
        try:
            while entries:
                top = entries[0]
                lst = kbucket[top[4]]
                if lst is None:
                    heapq.heappop(entries)
                    h.members.discard(top[4])
                    continue
                i = lst[-1]
                if avoid and i in avoid:
                    i = next((n for n in lst if n not in avoid), -1)
                    if i < 0:
                        skipped.append(heapq.heappop(entries))
                        continue
                return [self._apply(i, top[5], demand)]
            return None
        finally:
            for e in skipped:
                heapq.heappush(entries, e)

    def place_on(self, i: int, demand: Demand) -> Slot | None:
        """Place ``demand`` on node ``i`` (best option by the policy), or None if it does not fit."""
        key = self.keys[i] if i not in self.held else None
        if key is None:
            key = self._key(i)
        opts = self.options(key, demand)
        if not opts:
            return None
        _, opt = self.policy.choose(self, self.classes[key[0]], key, demand, opts)
        return self._apply(i, opt[1], demand)

    def _place_scan(self, demand: Demand, avoid: frozenset[int] = frozenset()) -> list[Slot] | None:
        """Uniform choice among all nodes with the best score (a random node for random-fit).

        Used by policies whose scores tie often and whose published form breaks ties uniformly at
        random between nodes (as kube-scheduler does); it costs one pass over the buckets.
        """
        fit = self.class_fit(demand)
        rng = self.rng
        pol = self.policy
        rand = pol.random_fit
        best = None
        cands: list[tuple[int, Key, Option]] = []
        total = 0
        for key, lst in self.buckets.items():
            pen = fit[key[0]]
            if pen is None or (best is not None and pen > best[0]):
                continue
            if avoid:
                lst = [n for n in lst if n not in avoid]
                if not lst:
                    continue
            opts = self.options(key, demand)
            if not opts:
                continue
            if rand:
                s = (pen, 0, 0.0)
                opt = opts[0] if len(opts) == 1 else rng.choice(opts)
            else:
                score, opt = pol.choose(self, self.classes[key[0]], key, demand, opts)
                s = (pen, opt[0], score)
            if best is None or s < best:
                best = s
                cands = [(len(lst), key, opt)]
                total = len(lst)
            elif s == best:
                cands.append((len(lst), key, opt))
                total += len(lst)
        if not cands:
            return None
        r = rng.randrange(total)
        for n, key, opt in cands:
            if r < n:
                lst = [m for m in self.buckets[key] if m not in avoid] if avoid else self.buckets[key]
                return [self._apply(lst[r], opt[1], demand)]
            r -= n
        raise AssertionError("unreachable")

    def _place_gang(
        self, demand: Demand, avoid: frozenset[int] = frozenset(), pick=None
    ) -> list[Slot] | None:
        fit = self.class_fit(demand)
        groups: dict[tuple[int, str, str], list[int]] = {}
        for key, lst in self.buckets.items():
            pen = fit[key[0]]
            if pen is None or key[1] < demand.cpu or key[2] < demand.mem or self.kept(key[0], demand):
                continue
            cls = self.classes[key[0]]
            if key[4] or any(f != MILLI for island in key[3] for f in island):
                continue
            groups.setdefault((pen, cls.model, cls.region), []).extend(n for n in lst if n not in avoid)
        for (_pen, _model, _region), members in sorted(groups.items()):
            if not members:
                continue
            per = self.classes[self.ncls[members[0]]].gpu_count
            need = demand.gpus // per
            if len(members) >= need:
                chosen = sorted(members)[:need] if pick is None else pick(sorted(members), need)
                if chosen is not None:
                    return [self.take_whole(i, demand) for i in chosen]
        return None

    def place_split(self, demand: Demand, avoid: frozenset[int] = frozenset()) -> list[Slot] | None:
        """Place ``demand`` as equal pieces on several nodes of one model (all or nothing): in one
        domain if it can, else in one region, else (``split_regions``) across regions; at each of
        those the largest pieces (fewest nodes) first, and the nodes that keep the fewest whole GPUs
        free (best fit), so that whole nodes stay whole for work that needs them."""
        if not demand.per_node:
            return None
        levels = (0, 1, 2) if demand.split_regions else (0, 1)
        cands: dict[int, list[tuple[int, str, str, str, int, int]]] = {}
        for k in demand.per_node:
            piece = replace(demand, gpus=k, per_node=(), split_regions=False)
            fit = self.class_fit(piece)
            rows = []
            for key, lst in self.buckets.items():
                pen = fit[key[0]]
                if pen is None or not self.options(key, piece):
                    continue
                cls = self.classes[key[0]]
                free = sum(isl.count(MILLI) for isl in key[3])
                rows.extend(
                    (pen, cls.model, cls.region, self.domain[i], free, i) for i in lst if i not in avoid
                )
            cands[k] = rows
        for level in levels:
            for k in demand.per_node:
                need = demand.gpus // k
                groups: dict[tuple, list[tuple[int, str, str, str, int, int]]] = {}
                for row in cands[k]:
                    if level == 0:
                        if not row[3]:
                            continue
                        gkey: tuple = (row[1], row[2], row[3])
                    elif level == 1:
                        gkey = (row[1], row[2])
                    else:
                        gkey = (row[1],)
                    groups.setdefault(gkey, []).append(row)
                best = None
                for rows in groups.values():
                    if len(rows) < need:
                        continue
                    chosen = sorted(rows, key=lambda r: (r[0], r[4], r[5]))[:need]
                    score = (max(r[0] for r in chosen), sum(r[4] for r in chosen), chosen[0][5])
                    if best is None or score < best[0]:
                        best = (score, chosen)
                if best is not None:
                    piece = replace(demand, gpus=k, per_node=(), split_regions=False)
                    slots = []
                    for r in best[1]:
                        s = self.place_on(r[5], piece)
                        if s is None:  # pragma: no cover - options were checked above
                            for done in slots:
                                self.release(done)
                            return None
                        slots.append(s)
                    return slots
        return None

    def take_whole(self, i: int, demand: Demand) -> Slot:
        """Give every GPU of node ``i`` (free) to ``demand`` (a gang's share of one node)."""
        cls = self.classes[self.ncls[i]]
        return self._apply(i, tuple((ii, MILLI) for ii, isl in enumerate(cls.islands) for _ in isl), demand)

    def _apply(self, i: int, picks: Picks, demand: Demand) -> Slot:
        cls = self.classes[self.ncls[i]]
        g = self.gfree[i]
        milli = share_units(cls, demand)
        ms = self.mstate[i]
        if demand.mig:
            return self._apply_mig(i, cls, picks, demand, milli)
        taken: list[int] = []
        for ii, free, *_ in picks:
            for p in cls.islands[ii]:
                if g[p] == free and p not in taken and (ms is None or ms[p] < 0):
                    taken.append(p)
                    break
            else:
                raise AssertionError("index out of step with node state")
        held = i in self.held
        if not held:
            self._leave(i)
        if self.keep and i in self.keep and demand.access == cls.reserved_for:
            # The owner's reserved work uses its share: that much less to keep for it.
            self.keep[i] = max(0, self.keep[i] - sum(1 for p in taken if g[p] == MILLI))
        for p in taken:
            g[p] -= milli
        self.cpu_free[i] -= demand.cpu
        self.mem_free[i] -= demand.mem
        if not held:
            self._enter(i)
        return Slot(i, tuple(taken), milli if taken else 0, demand.cpu, demand.mem)

    def _apply_mig(self, i: int, cls: NodeClass, picks: Picks, demand: Demand, milli: int) -> Slot:
        """Make ``demand``'s MIG instance on the GPU in MIG mode of ``picks`` (island, free, state)."""
        ms = self.mstate[i]
        (ii, _free, state), *_ = picks
        p = next((p for p in cls.islands[ii] if ms is not None and ms[p] == state), None)
        placed = M.place(cls.model, state, demand.mig)
        if p is None or ms is None or placed is None:
            raise AssertionError("index out of step with node state")
        start, use = placed
        held = i in self.held
        if not held:
            self._leave(i)
        ms[p] += use
        self.gfree[i][p] -= milli
        self.cpu_free[i] -= demand.cpu
        self.mem_free[i] -= demand.mem
        if not held:
            self._enter(i)
        return Slot(i, (p,), milli, demand.cpu, demand.mem, use, start)

    def release(self, slot: Slot) -> None:
        i = slot.node
        held = i in self.held
        if not held:
            self._leave(i)
        g = self.gfree[i]
        off = self.off[i]
        for p in slot.positions:
            if p not in off:
                g[p] += slot.milli
        ms = self.mstate[i]
        if slot.mig and ms is not None:
            for p in slot.positions:
                if ms[p] >= 0:
                    ms[p] -= slot.mig
        self.cpu_free[i] += slot.cpu
        self.mem_free[i] += slot.mem
        if not held and self.keys[i] is None and self.pos[i] == -1:
            self._enter(i)

    def allocate(self, slot: Slot) -> Slot:
        """Take what ``slot`` names on its node directly (existing allocations, preemption targets)."""
        i = slot.node
        held = i in self.held
        if not held:
            self._leave(i)
        g = self.gfree[i]
        ms = self.mstate[i]
        off = self.off[i]
        for p in slot.positions:
            if p not in off:
                g[p] -= slot.milli
            if slot.mig and ms is not None and ms[p] >= 0:
                ms[p] += slot.mig
        self.cpu_free[i] -= slot.cpu
        self.mem_free[i] -= slot.mem
        if not held:
            self._enter(i)
        return slot

    def hold(self, i: int) -> None:
        """Take a node out of the index (kept for the job at the head of the queue)."""
        if i not in self.held:
            self._leave(i)
            self.held.add(i)

    def unhold(self, i: int) -> None:
        if i in self.held:
            self.held.discard(i)
            self._enter(i)

    # -- reporting ---------------------------------------------------------------------------------

    def allocated_milli(self) -> int:
        """GPU milli held on READY nodes (capacity less what is free)."""
        free = 0
        for key, lst in self.buckets.items():
            free += sum(map(sum, key[3])) * len(lst)
            if key[4]:
                model = self.classes[key[0]].model
                free += sum(M.free_milli(model, st) for isl in key[4] for st in isl) * len(lst)
        for i in self.held:
            ms = self.mstate[i]
            if ms is None:
                free += sum(self.gfree[i])
            else:
                model = self.classes[self.ncls[i]].model
                free += sum(
                    f if m < 0 else M.free_milli(model, m) for f, m in zip(self.gfree[i], ms, strict=True)
                )
        return self.capacity_milli - free

    def fragmentation(self, dist) -> float:
        """Expected GPU milli that the workload ``dist`` cannot use, summed over indexed nodes."""
        from .fragmentation import node_fragmentation

        total = 0.0
        for key, lst in self.buckets.items():
            total += node_fragmentation(dist, self.classes[key[0]].model, key[1], key[2], key[3], True) * len(
                lst
            )
        return total
