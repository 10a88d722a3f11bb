"""Where a MIG instance can go on a GPU in MIG mode, by the hardware's profile table.

A GPU in MIG mode is one small integer in the placement index, its *state*: the memory slices its
instances hold (a bit each, bits 0-7), the compute slices they hold (bits 8-11), and the staff
layout it keeps (bits 12 and up: 0 when instances are made per workload, else an interned layout).
On a GPU without a layout a new instance takes the start that fits and leaves the most placements
open (``nodes.mig_profiles.best_start_free``); on a GPU with a layout it takes a free instance of the
layout of its profile (the agent made them when staff set the layout). A placement's *use*
(memory-slice bits plus compute slices << 8) is added to the state, and subtracted when it ends.
The answers are cached per (model, state, profile): the live cycle and the simulator share them.
"""

from __future__ import annotations

from functools import lru_cache

from nodes.mig_profiles import MigTable, best_start_free, table_for

COMPUTE_SHIFT = 8
LAYOUT_SHIFT = 12
MASK_BITS = (1 << COMPUTE_SHIFT) - 1
Layout = tuple[tuple[str, int], ...]
"""A staff layout: (profile, start) per instance, in start order."""

_layouts: dict[Layout, int] = {}
_layout_list: list[Layout] = [()]


def layout_id(layout: Layout) -> int:
    """A small integer for a layout (0 for none), the same for the life of the process."""
    if not layout:
        return 0
    key = tuple(sorted(layout, key=lambda item: item[1]))
    found = _layouts.get(key)
    if found is None:
        found = _layouts[key] = len(_layout_list)
        _layout_list.append(key)
    return found


@lru_cache(maxsize=64)
def table(model: str) -> MigTable | None:
    return table_for(model)


def use_of(model: str, profile: str, start: int) -> int:
    """The state bits an instance of ``profile`` at ``start`` takes on a GPU of ``model`` (0 when
    the model has no such profile: nothing to account)."""
    t = table(model)
    p = t.profile(profile) if t is not None else None
    if p is None:
        return 0
    return p.mask(start) | p.compute << COMPUTE_SHIFT


def state_of(model: str, layout: Layout, used: tuple[tuple[str, int], ...]) -> int:
    """The state of a GPU in MIG mode with a staff ``layout`` and the instances ``used`` by work."""
    state = layout_id(layout) << LAYOUT_SHIFT
    for profile, start in used:
        state += use_of(model, profile, start)
    return state


@lru_cache(maxsize=65536)
def place(model: str, state: int, profile: str) -> tuple[int, int] | None:
    """(start, use) of a new instance of ``profile`` on a GPU of ``model`` in ``state``, or None when
    the hardware cannot make one there."""
    t = table(model)
    p = t.profile(profile) if t is not None else None
    if p is None or t is None:
        return None
    mask = state & MASK_BITS
    compute = (state >> COMPUTE_SHIFT) & 0xF
    if compute + p.compute > t.compute_slices:
        return None
    layout = _layout_list[state >> LAYOUT_SHIFT]
    if layout:
        for name, start in layout:
            if name == profile and not mask & p.mask(start):
                return start, p.mask(start) | p.compute << COMPUTE_SHIFT
        return None
    start = best_start_free(t, mask, compute, profile)
    if start is None:
        return None
    return start, p.mask(start) | p.compute << COMPUTE_SHIFT


def free_milli(model: str, state: int) -> int:
    """The share of the GPU (of 1000) its free compute slices are."""
    t = table(model)
    if t is None:
        return 0
    return (t.compute_slices - ((state >> COMPUTE_SHIFT) & 0xF)) * 1000 // t.compute_slices
