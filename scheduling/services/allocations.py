"""Allocation rows: choosing the capacity range a share takes on its GPU, and packing ranges.

Every open allocation holds ``[milli_offset, milli_offset + fraction_milli)`` of its GPU and the
database refuses overlaps (see ``scheduling.models``). The offsets are bookkeeping: when shares come
and go a GPU can have enough free capacity in total but no single gap large enough; then the open
ranges are packed to the left first (``gpu_range_choose`` says which rows move). Moving each range,
in ascending order, to the end of the one before never overlaps a range not yet moved, so the
packing is valid row by row under the constraint.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduling.models import MILLI, Allocation

Range = tuple[int, int, int]
"""(offset, fraction, allocation id)."""


def gpu_range_choose(existing: Iterable[Range], fraction: int) -> tuple[int, list[tuple[int, int]]] | None:
    """Where a new share of ``fraction`` goes on a GPU whose open ranges are ``existing``: its
    offset and the (allocation id, new offset) moves to make first; None when it does not fit."""
    ranges = sorted(existing)
    used = sum(f for _, f, _ in ranges)
    if used + fraction > MILLI:
        return None
    at = 0
    for offset, f, _ in ranges:
        if offset - at >= fraction:
            return at, []
        at = max(at, offset + f)
    if MILLI - at >= fraction:
        return at, []
    moves: list[tuple[int, int]] = []
    at = 0
    for offset, f, alloc_id in ranges:
        if offset != at:
            moves.append((alloc_id, at))
        at += f
    return at, moves


def allocation_ranges_move(*, moves: list[tuple[int, int]]) -> None:
    """Apply packing moves in the order given (ascending offsets, as ``gpu_range_choose`` returns)."""
    for alloc_id, offset in moves:
        Allocation.objects.filter(pk=alloc_id, ended_at__isnull=True).update(milli_offset=offset)
