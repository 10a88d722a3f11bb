"""Reading the Alibaba cluster-trace-gpu-v2023 format (the data behind the ATC'23 FGD paper).

Nodes: ``sn,cpu_milli,memory_mib,gpu,model``. Pods: ``name,cpu_milli,memory_mib,num_gpu,gpu_milli,
gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time``. A pod with ``num_gpu`` 1 and
``gpu_milli`` under 1000 shares one GPU; ``num_gpu`` above 1 takes whole GPUs; ``gpu_spec`` (``A|B``)
lists the models allowed (empty: any).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from scheduling.engine.spec import Demand
from scheduling.engine.types import MILLI, Gpu, GpuModelInfo, Node


class TraceError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...]
    qos: str
    creation_time: int
    deletion_time: int | None
    gpus_per_node: tuple[int, ...] = ()
    """Piece sizes its GPUs may be split into over several nodes (column ``gpus_per_node``,
    sizes joined by ``|`` or ``any``); empty: one node."""

    @property
    def gpu_request_milli(self) -> int:
        """GPU asked for, in thousandths: the share for one GPU, 1000 per GPU for several."""
        if self.num_gpu == 0:
            return 0
        if self.num_gpu == 1:
            return self.gpu_milli
        return self.num_gpu * MILLI

    def demand(self, all_models: frozenset[str]) -> Demand:
        models = frozenset(self.gpu_spec) & all_models if self.gpu_spec else all_models
        milli = self.gpu_milli if self.num_gpu == 1 else MILLI
        per_node = tuple(
            sorted(
                {k for k in self.gpus_per_node if 0 < k < self.num_gpu and self.num_gpu % k == 0},
                reverse=True,
            )
        )
        return Demand(
            models=models,
            milli=milli,
            gpus=self.num_gpu,
            cpu=self.cpu_milli,
            mem=self.memory_mib,
            per_node=per_node,
        )


def _int(row: dict, col: str, path: Path, line: int, default: int | None = None) -> int:
    raw = (row.get(col) or "").strip()
    if raw == "" and default is not None:
        return default
    try:
        return int(float(raw))
    except ValueError:
        raise TraceError(f"{path}:{line}: column {col!r} is not a number: {raw!r}") from None


def _rows(path: Path, required: tuple[str, ...]):
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in required if c not in (reader.fieldnames or ())]
        if missing:
            raise TraceError(f"{path}: missing columns {', '.join(missing)}")
        yield from enumerate(reader, start=2)


def load_nodes(path: str | Path) -> tuple[list[Node], dict[str, GpuModelInfo]]:
    path = Path(path)
    nodes: list[Node] = []
    catalog: dict[str, GpuModelInfo] = {}
    for n, row in _rows(path, ("sn", "cpu_milli", "memory_mib", "gpu", "model")):
        model = (row["model"] or "").strip()
        ngpu = _int(row, "gpu", path, n)
        if ngpu and model and model not in catalog:
            catalog[model] = GpuModelInfo(name=model)
        nodes.append(
            Node(
                id=row["sn"],
                model=model,
                gpus=[Gpu(index=g) for g in range(ngpu)],
                cpu_milli=_int(row, "cpu_milli", path, n),
                memory_mib=_int(row, "memory_mib", path, n),
            )
        )
    return nodes, catalog


def _per_node(raw: str, path: Path, line: int) -> tuple[int, ...]:
    raw = raw.strip()
    if not raw:
        return ()
    if raw == "any":
        return tuple(range(1, 9))
    try:
        sizes = tuple(sorted({int(s) for s in raw.split("|") if s.strip()}))
    except ValueError:
        raise TraceError(f"{path}:{line}: gpus_per_node is sizes joined by | or 'any': {raw!r}") from None
    if not all(1 <= k <= 8 for k in sizes):
        raise TraceError(f"{path}:{line}: gpus_per_node sizes are 1-8: {raw!r}")
    return sizes


def load_pods(path: str | Path) -> list[TracePod]:
    path = Path(path)
    pods: list[TracePod] = []
    cols = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
    for n, row in _rows(path, cols):
        num_gpu = _int(row, "num_gpu", path, n)
        gpu_milli = _int(row, "gpu_milli", path, n, 0)
        if num_gpu < 0 or gpu_milli < 0 or gpu_milli > MILLI:
            raise TraceError(f"{path}:{n}: bad GPU request num_gpu={num_gpu} gpu_milli={gpu_milli}")
        if num_gpu == 1 and gpu_milli == 0:
            gpu_milli = MILLI
        spec = tuple(s.strip() for s in (row.get("gpu_spec") or "").split("|") if s.strip())
        deletion = (row.get("deletion_time") or "").strip()
        per_node = _per_node(row.get("gpus_per_node") or "", path, n)
        pods.append(
            TracePod(
                name=row["name"],
                cpu_milli=_int(row, "cpu_milli", path, n),
                memory_mib=_int(row, "memory_mib", path, n),
                num_gpu=num_gpu,
                gpu_milli=gpu_milli if num_gpu else 0,
                gpu_spec=spec,
                qos=(row.get("qos") or "").strip(),
                creation_time=_int(row, "creation_time", path, n, 0),
                deletion_time=_int(row, "deletion_time", path, n) if deletion else None,
                gpus_per_node=per_node,
            )
        )
    return pods
