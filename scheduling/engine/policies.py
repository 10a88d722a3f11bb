"""Placement policies: how a bucket of identical nodes scores for a demand (lower is better).

``choose`` gets every way the demand can be laid on the bucket's GPUs (``Option``: topology penalty,
picks, GPU state after) and returns the best score with its option. Topology comes first everywhere:
an option that spans more NVLink islands never beats one that spans fewer.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter

from .fragmentation import Distribution, can_host, host_weights, node_fragmentation, stranded, unusable
from .spec import Demand
from .state import ClusterState, Key, NodeClass, Option
from .types import MILLI


class Policy(ABC):
    name = "base"
    random_fit = False
    scan = False
    """True: uniform choice among all best-scoring nodes by a pass over the buckets (see
    ``ClusterState._place_scan``); False: the per-demand heaps, O(log buckets) per decision."""

    def choose(
        self, state: ClusterState, cls: NodeClass, key: Key, demand: Demand, opts: list[Option]
    ) -> tuple[float, Option]:
        best = None
        best_opt = opts[0]
        for opt in opts:
            s = (opt[0], self.score(state, cls, key, demand, opt))
            if best is None or s < best:
                best, best_opt = s, opt
        assert best is not None
        return best[1], best_opt

    @abstractmethod
    def score(self, state: ClusterState, cls: NodeClass, key: Key, demand: Demand, opt: Option) -> float:
        """Lower is better."""

    def set_distribution(self, dist: Distribution) -> None:
        """Fragmentation-aware policies score against this workload; others ignore it."""
        return None


class RandomFit(Policy):
    """A node chosen uniformly among those that fit (seeded), any fitting GPU."""

    name = "random"
    random_fit = True
    scan = True

    def score(self, state, cls, key, demand, opt) -> float:
        return 0.0


class BestFit(Policy):
    """Best-fit as in the ATC'23 baselines: least free CPU and GPU left on the node, each normalized
    by the largest server's capacity and weighted 1/2, scored 0..100 as an integer; ties are broken
    uniformly at random between nodes."""

    name = "bestfit"
    scan = True

    def score(self, state, cls, key, demand, opt) -> float:
        cpu_max, gpu_max = state.max_spec()
        left = 0.5 * (key[1] - demand.cpu) / cpu_max + 0.5 * sum(map(sum, opt[2])) / gpu_max
        s = -int((1.0 - left) * 100)
        if opt[1] and demand.milli < MILLI:
            # inside the node, the fullest GPU that fits
            s += (opt[1][0][1] - demand.milli) * 1e-7
        return s


class Packing(Policy):
    """Spreading's opposite on GPUs alone: fill partly used nodes first (the live 'packing' knob)."""

    name = "packing"

    def score(self, state, cls, key, demand, opt) -> float:
        return sum(map(sum, opt[2])) / MILLI


class Spreading(Policy):
    """Emptiest node first: lowest load, highest headroom (for latency-sensitive fleets)."""

    name = "spread"

    def score(self, state, cls, key, demand, opt) -> float:
        return -sum(map(sum, opt[2])) / MILLI


def sigmoid_score(delta_milli: float, scale: float) -> int:
    """kube-scheduler style integer score 0..100 of a fragmentation change (higher is better)."""
    x = delta_milli / scale
    if x > 50:
        return 0
    if x < -50:
        return 100
    return int(100.0 / (1.0 + math.exp(x)))


class FGD(Policy):
    """Fragmentation Gradient Descent (Weng et al., ATC'23): the node and GPU where the expected
    fragmentation of the node, against the workload's task mix, grows least.

    As published: the task types' CPU demand counts and RAM does not; the change is scored as
    ``int(100 * sigmoid(-delta / 1000))`` and ties are broken uniformly at random between nodes.
    """

    name = "fgd"
    use_mem = False
    scan = True
    scale = 1000.0
    balance = 0.0

    def __init__(self, dist: Distribution | None = None) -> None:
        self._memo: dict[tuple, float] = {}
        self.set_distribution(dist or Distribution(()))

    def set_distribution(self, dist: Distribution) -> None:
        self.dist = dist
        self._memo.clear()

    def frag(self, model: str, cpu: int, mem: int, gkey) -> float:
        k = (model, cpu, mem, gkey)
        v = self._memo.get(k)
        if v is None:
            v = self._memo[k] = node_fragmentation(
                self.dist, model, cpu, mem, gkey, self.use_mem, self.balance
            )
        return v

    def delta(self, cls: NodeClass, key: Key, demand: Demand, opt: Option) -> float:
        if self.use_mem:
            before = self.frag(cls.model, key[1], key[2], key[3])
            return self.frag(cls.model, key[1] - demand.cpu, key[2] - demand.mem, opt[2]) - before
        before = self.frag(cls.model, key[1], 0, key[3])
        return self.frag(cls.model, key[1] - demand.cpu, 0, opt[2]) - before

    def score(self, state, cls, key, demand, opt) -> float:
        return -sigmoid_score(self.delta(cls, key, demand, opt), self.scale)


class GpupoolPolicy(FGD):
    """gpupool's default: fragmentation gradient descent, measured against the work that can use the
    node, with a resource-balance look-ahead.

    * Fragmentation counts RAM as well as CPU: a GPU on a server whose RAM cannot host a task is as
      unusable to it as one whose CPU cannot.
    * Only the task types that could ever run on the node's hardware (model, GPU count, CPU, RAM)
      count, each weighted by how scarce that hardware is for it (``host_weights``) and the sum
      normalized by their total weight. FGD counts a node's whole free capacity as fragmented for
      every task that cannot use its model, so any placement on a model few tasks accept looks like
      it *removes* fragmentation, and flexible work is poured onto exactly the scarce models (or the
      only servers big enough) that constrained work needs. Here a placement on such a node costs
      what it costs the tasks that can go nowhere else.
    * Look-ahead (``balance``): FGD only asks whether the *next* task fits. Whatever arrives later,
      GPU capacity that the node's free CPU (or RAM) cannot feed at the workload's own CPU-per-GPU
      ratio (CPU-only tasks included) will be stranded once the node fills, so that amount counts
      as fragmentation too. This steers CPU-hungry work to CPU-rich servers before it strands GPUs.
      It is weighted 0.3: it assumes the node fills with the average mix, which whole-server
      (multi-GPU) work, whose CPU per GPU differs, does not do; at full weight it opened fresh
      CPU-poor servers for small GPU-heavy pods and left none whole for 8-GPU pods.
    * The change is compared on FGD's integer scale; ties go, in order, to the weakest GPU model the
      request accepts (catalog compute weight: strong GPUs stay free for work that needs them), to
      the better balance, and to best fit (least CPU and GPU left on the node, which keeps whole
      GPUs and servers free for multi-GPU work); within a node, the fullest GPU that fits.
    * It runs on the per-demand heaps (no pass over the fleet per decision); remaining exact ties
      go to a bucket drawn at random once per bucket.
    """

    name = "gpupool"
    use_mem = True
    scan = False
    scale = 1000.0
    balance = 0.3

    def set_distribution(self, dist: Distribution) -> None:
        super().set_distribution(dist)
        self._bind(None)

    def _bind(self, state: ClusterState | None) -> None:
        """Forget what depends on the workload or on the fleet (class ids, catalog)."""
        self._state = state
        self._weighted: tuple = ()
        self._class_types: dict[int, tuple[tuple, float]] = {}
        self._strength: dict[tuple[frozenset[str], str], float] = {}
        self._node_memo: dict[tuple, tuple[float, float]] = {}

    def _types_for(self, state: ClusterState, cls: NodeClass) -> tuple[tuple, float]:
        ct = self._class_types.get(cls.id)
        if ct is None:
            if not self._weighted and self.dist.types:
                count = Counter(state.ncls)
                servers: Counter[tuple[str, int, int, int]] = Counter()
                for c in state.classes:
                    servers[(c.model, c.gpu_count, c.cpu_cap, c.mem_cap)] += count[c.id]
                self._weighted = host_weights(self.dist, ((*k, n) for k, n in servers.items()))
            types = tuple(
                t
                for t in self._weighted
                if can_host(t, cls.model, cls.gpu_count, cls.cpu_cap, cls.mem_cap, self.use_mem)
            )
            ct = self._class_types[cls.id] = (types, sum(t[5] for t in types))
        return ct

    def _frag(self, state: ClusterState, cls: NodeClass, cpu: int, mem: int, gkey) -> tuple[float, float]:
        """(fragmentation, stranded look-ahead) of a node of class ``cls`` in this state."""
        k = (cls.id, cpu, mem, gkey)
        v = self._node_memo.get(k)
        if v is None:
            types, wsum = self._types_for(state, cls)
            frees = [f for island in gkey for f in island]
            total = sum(frees)
            frag = unusable(types, cpu, mem, frees, self.use_mem) / wsum if wsum and total else 0.0
            v = self._node_memo[k] = (frag, stranded(self.dist, cpu, mem, total, self.use_mem))
        return v

    def strength(self, state: ClusterState, cls: NodeClass, demand: Demand) -> float:
        """0 for the weakest model the demand accepts, 1 for the strongest (catalog compute weight)."""
        k = (demand.models, cls.model)
        v = self._strength.get(k)
        if v is None:
            cat = state.catalog
            ws = [cat[m].compute_weight for m in demand.models if m in cat]
            lo, hi = (min(ws), max(ws)) if ws else (0.0, 0.0)
            w = cat[cls.model].compute_weight if cls.model in cat else lo
            v = self._strength[k] = (w - lo) / (hi - lo) if hi > lo else 0.0
        return v

    def score(self, state, cls, key, demand, opt) -> float:
        if state is not self._state:
            self._bind(state)
        cpu, mem = key[1] - demand.cpu, key[2] - demand.mem
        after = self._frag(state, cls, cpu, mem, opt[2])
        before = self._frag(state, cls, key[1], key[2], key[3])
        frag, bal = after[0] - before[0], after[1] - before[1]
        cpu_max, gpu_max = state.max_spec()
        left = 0.5 * cpu / cpu_max + 0.5 * sum(map(sum, opt[2])) / gpu_max
        # |bal| <= gpu_max and left <= 1: each tie-break stays under the step of the one before it.
        s = -sigmoid_score(frag + self.balance * bal, self.scale)
        s += 0.5 * self.strength(state, cls, demand) + 0.25 * bal / gpu_max + 1e-5 * left
        if opt[1] and demand.milli < MILLI:
            s += (opt[1][0][1] - demand.milli) * 1e-10
        return s


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (GpupoolPolicy, FGD, BestFit, RandomFit, Packing, Spreading)
}
DEFAULT_POLICY = GpupoolPolicy.name


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
