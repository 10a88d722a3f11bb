"""The MIG profile tables of NVIDIA's MIG-capable GPUs, as the NVIDIA MIG user guide gives them.

A GPU in MIG mode is cut into *GPU instances*. Each profile (``3g.40gb``) takes a number of the GPU's
compute slices (7; an A30 has 4) and of its memory slices (8; an A30 has 4), and may only start at
certain memory-slice positions (the guide's "placements", what ``nvidia-smi mig -lgipp`` and
``nvmlDeviceGetGpuInstancePossiblePlacements`` list): a ``1g.20gb`` on an H100 takes 2 memory slices
and starts at 0, 2, 4 or 6, so at most 4 fit; ``3g.40gb`` starts at 0 or 4. Two instances never share
a memory slice, and their compute slices add up to at most the GPU's. The portal's engine, the staff
layout check and the node agent all read these tables, so the portal places only what the hardware
can make, at the start the hardware will be asked for.

The media-extension profiles (``+me``) are left out: the portal does not offer them.

Plain Python (the node agent imports it too).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MigProfile:
    name: str
    compute: int
    """Compute slices the instance takes."""
    memory: int
    """Memory slices the instance takes (its placement size)."""
    starts: tuple[int, ...]
    """The memory slices at which the hardware can start it."""
    nvml_profile: str
    """Suffix of the NVML constant ``NVML_GPU_INSTANCE_PROFILE_<suffix>`` naming the profile."""

    @property
    def max_count(self) -> int:
        """At most this many of the profile on one GPU (one per start: the starts do not overlap)."""
        return len(self.starts)

    def mask(self, start: int) -> int:
        """The memory slices (bit per slice) an instance started at ``start`` takes."""
        return ((1 << self.memory) - 1) << start


@dataclass(frozen=True, slots=True)
class MigTable:
    key: str
    compute_slices: int
    memory_slices: int
    profiles: tuple[MigProfile, ...]

    def profile(self, name: str) -> MigProfile | None:
        return next((p for p in self.profiles if p.name == name), None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.profiles)

    def fraction_milli(self, name: str) -> int:
        """The share of the GPU (of 1000) an instance of ``name`` is: its compute slices."""
        profile = self.profile(name)
        if profile is None:
            raise KeyError(name)
        return profile.compute * 1000 // self.compute_slices


def _seven(one: str, one_big: str, two: str, three_four: str, seven: str) -> tuple[MigProfile, ...]:
    """The seven-compute-slice, eight-memory-slice GPUs (A100, H100, H200) share one placement
    table; only the memory in the names differs: (1g small, 1g large, 2g, 3g and 4g, 7g)."""
    return (
        MigProfile(f"1g.{one}", 1, 1, (0, 1, 2, 3, 4, 5, 6), "1_SLICE"),
        MigProfile(f"1g.{one_big}", 1, 2, (0, 2, 4, 6), "1_SLICE_REV2"),
        MigProfile(f"2g.{two}", 2, 2, (0, 2, 4), "2_SLICE"),
        MigProfile(f"3g.{three_four}", 3, 4, (0, 4), "3_SLICE"),
        MigProfile(f"4g.{three_four}", 4, 4, (0,), "4_SLICE"),
        MigProfile(f"7g.{seven}", 7, 8, (0,), "7_SLICE"),
    )


A100_40 = MigTable("A100-40", 7, 8, _seven("5gb", "10gb", "10gb", "20gb", "40gb"))
A100_80 = MigTable("A100-80", 7, 8, _seven("10gb", "20gb", "20gb", "40gb", "80gb"))
H100_80 = MigTable("H100-80", 7, 8, _seven("10gb", "20gb", "20gb", "40gb", "80gb"))
H200_141 = MigTable("H200", 7, 8, _seven("18gb", "35gb", "35gb", "71gb", "141gb"))
A30_24 = MigTable(
    "A30",
    4,
    4,
    (
        MigProfile("1g.6gb", 1, 1, (0, 1, 2, 3), "1_SLICE"),
        MigProfile("2g.12gb", 2, 2, (0, 2), "2_SLICE"),
        MigProfile("4g.24gb", 4, 4, (0,), "4_SLICE"),
    ),
)
TABLES: tuple[MigTable, ...] = (A100_40, A100_80, H100_80, H200_141, A30_24)


def table_for(gpu_name: str) -> MigTable | None:
    """The table of a GPU by its catalog name or the name NVML reports (``NVIDIA A100-SXM4-80GB``,
    ``NVIDIA H100 80GB HBM3``); None for a GPU without MIG."""
    name = (gpu_name or "").upper().replace("-", " ")
    words = set(name.replace("_", " ").split())
    if "H200" in name:
        return H200_141
    if "H100" in name:
        # The H100 NVL (94 GB) and GH200 (96 GB) have other tables: not offered.
        return None if ("NVL" in words or "94GB" in name or "96GB" in name) else H100_80
    if "A100" in name:
        return A100_80 if "80GB" in name.replace(" ", "") else A100_40
    if "A30" in words:
        return A30_24
    return None


def occupancy(table: MigTable, used: Iterable[tuple[str, int]]) -> tuple[int, int] | None:
    """(memory-slice mask, compute slices) of the instances ``used`` ((profile, start) pairs); None
    when one is not a profile of the table."""
    mask = compute = 0
    for name, start in used:
        q = table.profile(name)
        if q is None:
            return None
        mask |= q.mask(start)
        compute += q.compute
    return mask, compute


def starts_free(table: MigTable, mask: int, compute: int, profile: str) -> list[int]:
    """Every start at which an instance of ``profile`` fits on a GPU whose instances hold the memory
    slices ``mask`` and ``compute`` compute slices: a start the profile may take, on free memory
    slices, within the GPU's compute slices. (A profile's count needs no check of its own: its
    starts do not overlap, so at most ``max_count`` fit.)"""
    p = table.profile(profile)
    if p is None or compute + p.compute > table.compute_slices:
        return []
    return [start for start in p.starts if not mask & p.mask(start)]


def fit_starts(table: MigTable, used: Iterable[tuple[str, int]], profile: str) -> list[int]:
    """``starts_free`` beside the instances ``used``."""
    occupied = occupancy(table, used)
    return [] if occupied is None else starts_free(table, *occupied, profile)


def best_start_free(table: MigTable, mask: int, compute: int, profile: str) -> int | None:
    """The start for a new instance of ``profile``: of those that fit, the one that leaves the most
    placements (of every profile) open for later instances; None when none fits."""
    starts = starts_free(table, mask, compute, profile)
    if len(starts) <= 1:
        return starts[0] if starts else None
    p = table.profile(profile)
    assert p is not None

    def left_open(start: int) -> int:
        after = mask | p.mask(start)
        return sum(1 for q in table.profiles for s in q.starts if not after & q.mask(s))

    return max(starts, key=lambda s: (left_open(s), -s))


def best_start(table: MigTable, used: Iterable[tuple[str, int]], profile: str) -> int | None:
    """``best_start_free`` beside the instances ``used``."""
    occupied = occupancy(table, used)
    return None if occupied is None else best_start_free(table, *occupied, profile)


def layout_placements(table: MigTable, profiles: Iterable[str]) -> list[tuple[str, int]]:
    """Starts for a staff layout (a list of profiles), found by trying the starts of each profile,
    largest first; raises ValueError naming a profile that is not in the table, or saying that the
    layout does not fit the GPU."""
    wanted = list(profiles)
    for name in wanted:
        if table.profile(name) is None:
            raise ValueError(f"{name} is not a MIG profile of this GPU (it has {', '.join(table.names)})")
    order = sorted(wanted, key=lambda name: (-table.profile(name).memory, name))  # type: ignore[union-attr]

    def place(k: int, placed: list[tuple[str, int]]) -> list[tuple[str, int]] | None:
        if k == len(order):
            return placed
        for start in fit_starts(table, placed, order[k]):
            found = place(k + 1, [*placed, (order[k], start)])
            if found is not None:
                return found
        return None

    found = place(0, [])
    if found is None:
        raise ValueError(
            f"{' + '.join(wanted)} does not fit one GPU: it has {table.memory_slices} memory and "
            f"{table.compute_slices} compute slices, and each profile only certain starts"
        )
    return sorted(found, key=lambda item: item[1])


def check_placements(table: MigTable, placements: Iterable[tuple[str, int]]) -> None:
    """Raise ValueError unless every (profile, start) is a valid placement and none overlaps."""
    placed: list[tuple[str, int]] = []
    for name, start in placements:
        if table.profile(name) is None:
            raise ValueError(f"{name} is not a MIG profile of this GPU")
        if start not in fit_starts(table, placed, name):
            raise ValueError(f"{name} cannot start at memory slice {start} beside the other instances")
        placed.append((name, start))


def layout_from_json(value: object) -> tuple[tuple[str, int], ...]:
    """A stored layout (``[{"profile", "start"}]``, as ``Gpu.mig_layout`` keeps it) as (profile,
    start) pairs in start order; rows of another shape are left out."""
    out = []
    for row in value if isinstance(value, list) else []:
        if isinstance(row, dict) and isinstance(row.get("profile"), str) and type(row.get("start")) is int:
            out.append((row["profile"], row["start"]))
    return tuple(sorted(out, key=lambda item: item[1]))
