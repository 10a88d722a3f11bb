"""The GPU catalog, from vendors' public specification sheets, and the name matching for agents.

Throughput figures are *dense* (no structured sparsity) tensor TFLOPS in BF16, or FP16 where the
product has no BF16 (T4, V100, P100). FP32 is the non-tensor (vector) peak.

**Compute weight** (relative to H100 SXM = 1.00), rounded to two places::

    weight = 0.5 * sqrt(bf16_tflops / 989.4) + 0.5 * sqrt(memory_bandwidth_gbps / 3350)

Real workloads do not scale linearly with peak throughput (they are partly memory-bound and
communication-bound), so both terms are square-rooted and compute and memory bandwidth count
half each. That gives T4 = 0.28, A100 80GB = 0.67, L4 = 0.33, H200 = 1.10, MI300X = 1.20. Staff may
edit a weight in the admin; seeding sets it only when it creates the row.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal

from nodes import mig_profiles

H100_BF16_DENSE_TFLOPS = 989.4
H100_MEMORY_BANDWIDTH_GBPS = 3350


def compute_weight(bf16_tflops: float, memory_bandwidth_gbps: float) -> Decimal:
    w = 0.5 * math.sqrt(bf16_tflops / H100_BF16_DENSE_TFLOPS) + 0.5 * math.sqrt(
        memory_bandwidth_gbps / H100_MEMORY_BANDWIDTH_GBPS
    )
    return Decimal(str(w)).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)


@dataclass(frozen=True)
class GpuSpec:
    vendor: str
    name: str
    short_name: str
    architecture: str
    memory_gib: int
    bf16_tflops: float
    fp32_tflops: float
    memory_bandwidth_gbps: int
    software_stack: str
    cuda_compute_capability: str = ""
    gfx_target: str = ""
    mig_profiles: tuple[str, ...] = ()
    aliases: tuple[str, ...] = field(default_factory=tuple)
    spec_source: str = ""

    @property
    def weight(self) -> Decimal:
        return compute_weight(self.bf16_tflops, self.memory_bandwidth_gbps)


# MIG profiles from the hardware's tables (nodes/mig_profiles.py: slices, starts, counts).
_MIG_40 = mig_profiles.A100_40.names
_MIG_80 = mig_profiles.A100_80.names
_MIG_H100 = mig_profiles.H100_80.names
_MIG_141 = mig_profiles.H200_141.names
_MIG_A30 = mig_profiles.A30_24.names

CATALOG: tuple[GpuSpec, ...] = (
    GpuSpec(
        "nvidia", "NVIDIA H200 SXM 141GB", "H200", "Hopper", 141, 989.4, 67.0, 4800, "cuda", "9.0",
        mig_profiles=_MIG_141, aliases=("NVIDIA H200", "H200"),
        spec_source="NVIDIA H200 Tensor Core GPU datasheet",
    ),
    GpuSpec(
        "nvidia", "NVIDIA H100 SXM 80GB", "H100", "Hopper", 80, 989.4, 67.0, 3350, "cuda", "9.0",
        mig_profiles=_MIG_H100, aliases=("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB", "H100"),
        spec_source="NVIDIA H100 Tensor Core GPU datasheet (SXM)",
    ),
    GpuSpec(
        "nvidia", "NVIDIA H100 PCIe 80GB", "H100-PCIe", "Hopper", 80, 756.0, 51.0, 2000, "cuda", "9.0",
        mig_profiles=_MIG_H100, aliases=("NVIDIA H100 PCIe", "H100-PCIE"),
        spec_source="NVIDIA H100 Tensor Core GPU datasheet (PCIe)",
    ),
    GpuSpec(
        "nvidia", "NVIDIA A100 SXM 80GB", "A100-80", "Ampere", 80, 312.0, 19.5, 2039, "cuda", "8.0",
        mig_profiles=_MIG_80,
        aliases=("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-80GB", "A100-80"),
        spec_source="NVIDIA A100 Tensor Core GPU datasheet",
    ),
    GpuSpec(
        "nvidia", "NVIDIA A100 SXM 40GB", "A100-40", "Ampere", 40, 312.0, 19.5, 1555, "cuda", "8.0",
        mig_profiles=_MIG_40, aliases=("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB", "A100-40"),
        spec_source="NVIDIA A100 Tensor Core GPU datasheet",
    ),
    GpuSpec(
        "nvidia", "NVIDIA A30", "A30", "Ampere", 24, 165.0, 10.3, 933, "cuda", "8.0",
        mig_profiles=_MIG_A30, aliases=("NVIDIA A30", "A30"),
        spec_source="NVIDIA A30 Tensor Core GPU datasheet",
    ),
    GpuSpec(
        "nvidia", "NVIDIA L40S", "L40S", "Ada Lovelace", 48, 362.1, 91.6, 864, "cuda", "8.9",
        aliases=("L40S",), spec_source="NVIDIA L40S datasheet",
    ),
    GpuSpec(
        "nvidia", "NVIDIA L4", "L4", "Ada Lovelace", 24, 121.0, 30.3, 300, "cuda", "8.9",
        aliases=("L4",), spec_source="NVIDIA L4 Tensor Core GPU datasheet",
    ),
    GpuSpec(
        "nvidia", "NVIDIA A10", "A10", "Ampere", 24, 125.0, 31.2, 600, "cuda", "8.6",
        aliases=("A10",), spec_source="NVIDIA A10 Tensor Core GPU datasheet",
    ),
    GpuSpec(
        "nvidia", "NVIDIA T4", "T4", "Turing", 16, 65.0, 8.1, 320, "cuda", "7.5",
        aliases=("Tesla T4", "T4"), spec_source="NVIDIA T4 Tensor Core GPU datasheet (FP16 mixed)",
    ),
    GpuSpec(
        "nvidia", "NVIDIA V100 SXM2 16GB", "V100-16", "Volta", 16, 125.0, 15.7, 900, "cuda", "7.0",
        aliases=("Tesla V100-SXM2-16GB", "Tesla V100-PCIE-16GB", "V100M16"),
        spec_source="NVIDIA V100 Tensor Core GPU datasheet (SXM2, FP16 tensor)",
    ),
    GpuSpec(
        "nvidia", "NVIDIA V100 SXM2 32GB", "V100-32", "Volta", 32, 125.0, 15.7, 900, "cuda", "7.0",
        aliases=("Tesla V100-SXM2-32GB", "Tesla V100-PCIE-32GB", "Tesla V100S-PCIE-32GB", "V100M32"),
        spec_source="NVIDIA V100 Tensor Core GPU datasheet (SXM2, FP16 tensor)",
    ),
    GpuSpec(
        "nvidia", "NVIDIA P100 PCIe 16GB", "P100", "Pascal", 16, 18.7, 9.3, 732, "cuda", "6.0",
        aliases=("Tesla P100-PCIE-16GB", "Tesla P100-SXM2-16GB", "P100"),
        spec_source="NVIDIA Tesla P100 datasheet (PCIe, FP16)",
    ),
    GpuSpec(
        "amd", "AMD Instinct MI300X", "MI300X", "CDNA 3", 192, 1307.4, 163.4, 5300, "rocm",
        gfx_target="gfx942", aliases=("AMD Instinct MI300X OAM", "MI300X"),
        spec_source="AMD Instinct MI300X data sheet",
    ),
    GpuSpec(
        "amd", "AMD Instinct MI250", "MI250", "CDNA 2", 128, 362.1, 45.3, 3277, "rocm",
        gfx_target="gfx90a", aliases=("MI250",), spec_source="AMD Instinct MI250 data sheet",
    ),
    GpuSpec(
        "intel", "Intel Data Center GPU Max 1550", "Max-1550", "Xe-HPC (Ponte Vecchio)", 128, 838.9, 52.4,
        3277, "oneapi", gfx_target="pvc", aliases=("Intel(R) Data Center GPU Max 1550", "Max 1550"),
        spec_source="Intel Data Center GPU Max Series product brief",
    ),
    GpuSpec(
        "intel", "Intel Data Center GPU Max 1100", "Max-1100", "Xe-HPC (Ponte Vecchio)", 48, 352.0, 22.2,
        1229, "oneapi", gfx_target="pvc", aliases=("Intel(R) Data Center GPU Max 1100", "Max 1100"),
        spec_source="Intel Data Center GPU Max Series product brief (PCIe card)",
    ),
)  # fmt: skip


_SPACES = re.compile(r"[\s_]+")


def normalize_gpu_name(name: str) -> str:
    return _SPACES.sub(" ", (name or "").strip().lower())


def catalog_seed(*, using: str = "default") -> tuple[int, int]:
    """Create or update every catalog entry by name; a second run changes nothing. Returns
    (created, updated). Keeps a compute weight that staff edited. Runs after every ``migrate``
    (``NodesConfig``), from ``seed_catalog`` and from ``seed_demo``."""
    from nodes.models import GpuModel

    created = updated = 0
    for spec in CATALOG:
        defaults = {
            "vendor": spec.vendor,
            "short_name": spec.short_name,
            "architecture": spec.architecture,
            "aliases": list(spec.aliases),
            "memory_gib": spec.memory_gib,
            "bf16_tflops": Decimal(str(spec.bf16_tflops)),
            "fp32_tflops": Decimal(str(spec.fp32_tflops)),
            "memory_bandwidth_gbps": spec.memory_bandwidth_gbps,
            "mig_capable": bool(spec.mig_profiles),
            "mig_profiles": list(spec.mig_profiles),
            "software_stack": spec.software_stack,
            "cuda_compute_capability": spec.cuda_compute_capability,
            "gfx_target": spec.gfx_target,
            "spec_source": spec.spec_source,
        }
        existing = GpuModel.objects.using(using).filter(name=spec.name).first()
        if existing is None:
            GpuModel.objects.using(using).create(name=spec.name, compute_weight=spec.weight, **defaults)
            created += 1
            continue
        changed = [k for k, v in defaults.items() if getattr(existing, k) != v]
        if changed:
            for k in changed:
                setattr(existing, k, defaults[k])
            existing.save(update_fields=changed, using=using)
            updated += 1
    return created, updated
