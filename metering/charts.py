"""Small server-side SVG charts for the finance pages: no JavaScript, no network, printable.

``bar_chart(categories, series)`` draws grouped (or stacked) vertical bars with a y axis, a legend
and a ``<title>`` on every bar for its exact value; ``line_chart(labels, values, levels=...)`` one line
with a point per value and dashed horizontal levels (the dashboard's cost against the budget). Labels
are escaped here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import Decimal

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

PALETTE = ["#4f46e5", "#0ea5e9", "#10b981", "#f59e0b", "#ef4444", "#8b5cf6", "#ec4899", "#14b8a6"]
OTHER_COLOUR = "#94a3b8"


def _nice_max(value: float) -> float:
    """The smallest 1, 2, 2.5 or 5 times a power of ten at least ``value``."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if step * power >= value:
            return step * power
    return 10 * power


def _fmt(value: float) -> str:
    if abs(value) >= 1_000_000:
        return f"{value / 1_000_000:g}M"
    if abs(value) >= 1_000:
        return f"{value / 1_000:g}k"
    return f"{value:g}"


def bar_chart(
    categories: list[str],
    series: list[tuple[str, list[Decimal | float | int | None]]],
    *,
    unit: str = "",
    stacked: bool = False,
    title: str = "",
    width: int = 720,
    height: int = 260,
) -> SafeString:
    """One group of bars per category, one bar per series (or one stacked bar per category)."""
    left, right, top, bottom = 56, 12, 28, 64
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [[float(v or 0) for v in vals] for _, vals in series]
    if stacked:
        peak = max((sum(max(v[i], 0) for v in values) for i in range(len(categories))), default=0)
    else:
        peak = max((max(v, default=0) for v in values), default=0)
    top_value = _nice_max(peak)
    out = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="100%" role="img" '
        f'aria-label="{escape(title or "Chart")}" xmlns="http://www.w3.org/2000/svg">',
    ]
    if title:
        out.append(f"<title>{escape(title)}</title>")
    for i in range(5):
        v = top_value * i / 4
        y = top + plot_h - plot_h * i / 4
        out.append(
            f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e2e8f0"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11" fill="#64748b">'
            f"{_fmt(v)}</text>"
        )
    n = max(len(categories), 1)
    group_w = plot_w / n
    bars = 1 if stacked else max(len(series), 1)
    bar_w = max(2.0, group_w * 0.8 / bars)
    for ci, cat in enumerate(categories):
        x0 = left + ci * group_w + group_w * 0.1
        base = 0.0
        for si, (label, _) in enumerate(series):
            v = values[si][ci] if ci < len(values[si]) else 0.0
            colour = PALETTE[si % len(PALETTE)] if label != "Other" else OTHER_COLOUR
            h = plot_h * max(v, 0) / top_value
            x = x0 if stacked else x0 + si * bar_w
            y = top + plot_h - h - (plot_h * base / top_value if stacked else 0)
            if stacked:
                base += max(v, 0)
            out.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w - 1:.1f}" height="{h:.1f}" fill="{colour}">'
                f"<title>{escape(cat)} · {escape(label)}: {v:,.2f}{(' ' + escape(unit)) if unit else ''}</title></rect>"
            )
        out.append(
            f'<text x="{x0 + group_w * 0.4:.1f}" y="{top + plot_h + 16}" text-anchor="middle" '
            f'font-size="11" fill="#475569">{escape(cat)}</text>'
        )
    lx = left
    for si, (label, _) in enumerate(series):
        colour = PALETTE[si % len(PALETTE)] if label != "Other" else OTHER_COLOUR
        text = escape(label[:28])
        out.append(
            f'<rect x="{lx}" y="{height - 22}" width="10" height="10" fill="{colour}"/>'
            f'<text x="{lx + 14}" y="{height - 13}" font-size="11" fill="#334155">{text}</text>'
        )
        lx += 24 + 7 * len(label[:28])
        if lx > width - 80:
            break
    if unit:
        out.append(f'<text x="8" y="12" font-size="11" fill="#64748b">{escape(unit)}</text>')
    out.append("</svg>")
    return mark_safe("".join(out))  # every label above is escaped


def line_chart(
    labels: list[str],
    values: list[Decimal | float | int | None],
    *,
    levels: Sequence[tuple[str, Decimal | float | int]] = (),
    unit: str = "",
    title: str = "",
    width: int = 360,
    height: int = 140,
) -> SafeString:
    """One line through ``values`` (``None``: no point yet, e.g. a day still to come) over the x axis
    of ``labels``, and a dashed horizontal line per ``(label, value)`` of ``levels`` (a budget)."""
    left, right, top, bottom = 44, 8, 12, 20
    plot_w, plot_h = width - left - right, height - top - bottom
    known = [float(v) for v in values if v is not None]
    top_value = _nice_max(max([*known, *(float(v) for _, v in levels)], default=0))
    n = max(len(labels) - 1, 1)

    def y_of(v: float) -> float:
        return top + plot_h - plot_h * max(v, 0) / top_value

    out = [
        f'<svg class="chart chart-line" viewBox="0 0 {width} {height}" width="100%" role="img" '
        f'aria-label="{escape(title or "Chart")}" xmlns="http://www.w3.org/2000/svg">',
    ]
    if title:
        out.append(f"<title>{escape(title)}</title>")
    for i in (0, 2, 4):
        v = top_value * i / 4
        y = y_of(v)
        out.append(
            f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e2e8f0"/>'
            f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="10" fill="#64748b">'
            f"{_fmt(v)}</text>"
        )
    if labels:
        for i in sorted({0, len(labels) - 1}):
            out.append(
                f'<text x="{left + plot_w * i / n:.1f}" y="{height - 4}" text-anchor="middle" font-size="10" '
                f'fill="#475569">{escape(labels[i])}</text>'
            )
    for si, (label, v) in enumerate(levels):
        y = y_of(float(v))
        colour = PALETTE[(si + 4) % len(PALETTE)]
        out.append(
            f'<line data-level x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="{colour}" '
            f'stroke-dasharray="4 3"><title>{escape(label)}: {float(v):,.2f}{(" " + escape(unit)) if unit else ""}'
            f"</title></line>"
            f'<text x="{width - right}" y="{y - 3:.1f}" text-anchor="end" font-size="10" fill="{colour}">'
            f"{escape(label)}</text>"
        )
    points = [
        (left + plot_w * i / n, y_of(float(v)), labels[i], float(v))
        for i, v in enumerate(values)
        if v is not None and i < len(labels)
    ]
    if points:
        out.append(
            f'<polyline fill="none" stroke="{PALETTE[0]}" stroke-width="2" points="'
            + " ".join(f"{x:.1f},{y:.1f}" for x, y, _, _ in points)
            + '"/>'
        )
        for x, y, label, v in points:
            out.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{PALETTE[0]}"><title>{escape(label)}: '
                f"{v:,.2f}{(' ' + escape(unit)) if unit else ''}</title></circle>"
            )
    out.append("</svg>")
    return mark_safe("".join(out))  # every label above is escaped
