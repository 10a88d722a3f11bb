"""Billing periods: calendar months in UTC, half-open ``[first day 00:00, first day of next month)``."""

from __future__ import annotations

from datetime import UTC, date, datetime


def period_of(at: datetime) -> date:
    """The first day of the (UTC) month ``at`` falls in."""
    at = at.astimezone(UTC)
    return date(at.year, at.month, 1)


def next_period(period_start: date) -> date:
    if period_start.month == 12:
        return date(period_start.year + 1, 1, 1)
    return date(period_start.year, period_start.month + 1, 1)


def previous_period(period_start: date) -> date:
    if period_start.month == 1:
        return date(period_start.year - 1, 12, 1)
    return date(period_start.year, period_start.month - 1, 1)


def period_bounds(period_start: date) -> tuple[datetime, datetime]:
    end = next_period(period_start)
    return (
        datetime(period_start.year, period_start.month, 1, tzinfo=UTC),
        datetime(end.year, end.month, 1, tzinfo=UTC),
    )


def days_in_period(period_start: date) -> int:
    return (next_period(period_start) - period_start).days


def period_starts_between(start: datetime, end: datetime) -> list[datetime]:
    """Month boundaries strictly inside ``(start, end)``."""
    out = []
    p = next_period(period_of(start))
    while True:
        at = datetime(p.year, p.month, 1, tzinfo=UTC)
        if at >= end:
            return out
        out.append(at)
        p = next_period(p)


def split_interval(start: datetime, end: datetime, cuts) -> list[tuple[datetime, datetime]]:
    """``[start, end)`` cut at every point of ``cuts`` strictly inside it, in order; the pieces are
    contiguous and cover it exactly."""
    points = sorted({c for c in cuts if start < c < end})
    edges = [start, *points, end]
    return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1) if edges[i] < edges[i + 1]]
