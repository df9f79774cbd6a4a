"""Inline SVG charts for the status page: pure functions from numbers to markup.

Every label is escaped here, so a chart is safe to embed whatever its series are
called. Points are drawn as ``<circle class="pt">`` (one per value) joined by a
polyline, so 0, 1 and many points all render: 0 says "no data yet", 1 is a dot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

__all__ = [
    "MAX_POINTS",
    "PALETTE",
    "Bar",
    "Scale",
    "Series",
    "bar_rows",
    "line_chart",
    "nice_number",
    "thin",
]

#: Series colours, in order (distinguishable, readable on white).
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b")

#: Points drawn per series at most (thinned evenly beyond).
MAX_POINTS = 200

_PAD_LEFT, _PAD_RIGHT, _PAD_TOP, _PAD_BOTTOM = 56.0, 12.0, 12.0, 30.0


@dataclass(frozen=True, slots=True)
class Series:
    """One named line of (x, y) points; non-finite y values are left out."""

    name: str
    points: Sequence[tuple[float, float]]

    def finite(self) -> list[tuple[float, float]]:
        return [(x, y) for x, y in self.points if math.isfinite(x) and math.isfinite(y)]


@dataclass(frozen=True, slots=True)
class Scale:
    """A linear map from data ``[low, high]`` to pixels ``[start, end]``.

    A degenerate range (one value, or none) is widened around its value, so a single
    point lands in the middle of the axis instead of dividing by zero.
    """

    low: float
    high: float
    start: float
    end: float

    @classmethod
    def fit(cls, values: Sequence[float], start: float, end: float) -> Scale:
        if not values:
            return cls(0.0, 1.0, start, end)
        low, high = min(values), max(values)
        if high - low <= 1e-12 * max(1.0, abs(low)):
            pad = max(abs(low) * 0.05, 0.5)
            low, high = low - pad, high + pad
        return cls(low, high, start, end)

    def __call__(self, value: float) -> float:
        return self.start + (value - self.low) / (self.high - self.low) * (self.end - self.start)


def nice_number(value: float) -> str:
    """A short label for an axis tick: 4 significant digits, no trailing noise."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else escape(str(value))
    return f"{value:.4g}"


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    x_label: str = "round",
    width: int = 480,
    height: int = 220,
    css_class: str = "chart",
    max_points: int = MAX_POINTS,
) -> str:
    """An SVG line chart of ``series`` (x: ``x_label``), with a legend and min/max ticks.

    A series longer than ``max_points`` is drawn thinned (:func:`thin`): the page stays
    small however long the job has run.
    """
    drawn = [(s, thin(s.finite(), max_points)) for s in series]
    xs = [x for _, points in drawn for x, _ in points]
    ys = [y for _, points in drawn for _, y in points]
    legend_h = 16.0 * len(series)
    plot_bottom = height - _PAD_BOTTOM - legend_h
    scale_x = Scale.fit(xs, _PAD_LEFT, width - _PAD_RIGHT)
    scale_y = Scale.fit(ys, plot_bottom, _PAD_TOP)
    parts = [
        f'<svg class="{escape(css_class)}" xmlns="http://www.w3.org/2000/svg" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<rect x="{_PAD_LEFT}" y="{_PAD_TOP}" width="{width - _PAD_LEFT - _PAD_RIGHT}" '
        f'height="{plot_bottom - _PAD_TOP:.1f}" fill="none" stroke="#ccc"/>',
    ]
    if not xs:
        parts.append(
            f'<text class="empty" x="{width / 2:.1f}" y="{(plot_bottom + _PAD_TOP) / 2:.1f}" '
            'text-anchor="middle" fill="#888">no data yet</text>'
        )
    else:
        parts.extend(_ticks(scale_x, scale_y, plot_bottom, x_label))
    for index, (one, points) in enumerate(drawn):
        colour = PALETTE[index % len(PALETTE)]
        name = escape(one.name)
        if len(points) > 1:
            path = " ".join(f"{scale_x(x):.1f},{scale_y(y):.1f}" for x, y in points)
            parts.append(
                f'<polyline class="line" data-series="{name}" points="{path}" fill="none" '
                f'stroke="{colour}" stroke-width="2"/>'
            )
        for x, y in points:
            parts.append(
                f'<circle class="pt" data-series="{name}" cx="{scale_x(x):.1f}" '
                f'cy="{scale_y(y):.1f}" r="3" fill="{colour}">'
                f"<title>{name}: {nice_number(x)}, {nice_number(y)}</title></circle>"
            )
        legend_y = plot_bottom + _PAD_BOTTOM + 16.0 * index - 2
        parts.append(
            f'<rect x="{_PAD_LEFT}" y="{legend_y - 9:.1f}" width="10" height="10" '
            f'fill="{colour}"/><text x="{_PAD_LEFT + 16}" y="{legend_y:.1f}">{name}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def thin(points: Sequence[tuple[float, float]], limit: int) -> list[tuple[float, float]]:
    """At most ``limit`` of ``points``, evenly spaced, always with the first and last."""
    if len(points) <= limit:
        return list(points)
    if limit < 2:
        return list(points[-limit:]) if limit > 0 else []
    step = (len(points) - 1) / (limit - 1)
    return [points[round(i * step)] for i in range(limit)]


def _ticks(scale_x: Scale, scale_y: Scale, plot_bottom: float, x_label: str) -> list[str]:
    """Labels at both ends of each axis, and the x axis's name."""
    left, right = scale_x.start, scale_x.end
    return [
        f'<text class="tick" x="{left - 4:.1f}" y="{plot_bottom:.1f}" text-anchor="end">'
        f"{nice_number(scale_y.low)}</text>",
        f'<text class="tick" x="{left - 4:.1f}" y="{scale_y.end + 10:.1f}" text-anchor="end">'
        f"{nice_number(scale_y.high)}</text>",
        f'<text class="tick" x="{left:.1f}" y="{plot_bottom + 14:.1f}" text-anchor="start">'
        f"{nice_number(scale_x.low)}</text>",
        f'<text class="tick" x="{right:.1f}" y="{plot_bottom + 14:.1f}" text-anchor="end">'
        f"{nice_number(scale_x.high)}</text>",
        f'<text class="tick" x="{(left + right) / 2:.1f}" y="{plot_bottom + 14:.1f}" '
        f'text-anchor="middle">{escape(x_label)}</text>',
    ]


@dataclass(frozen=True, slots=True)
class Bar:
    """One horizontal segment of a timeline row, in seconds from the row's origin."""

    start: float
    end: float
    kind: str  # a CSS-safe word: "work", "train", "comm", "other" or "wait"
    label: str


_BAR_COLOURS = {
    "work": "#1f77b4",
    "train": "#2ca02c",
    "comm": "#ff7f0e",
    "other": "#c6dbef",
    "wait": "#d9d9d9",
}


def bar_rows(
    rows: Sequence[tuple[str, Sequence[Bar]]],
    *,
    title: str,
    width: int = 480,
    row_height: int = 16,
) -> str:
    """A timeline: one row of bars per label, on one shared seconds axis."""
    ends = [bar.end for _, bars in rows for bar in bars if math.isfinite(bar.end)]
    label_w = 150.0
    scale = Scale(0.0, max([*ends, 1e-9]), label_w, width - _PAD_RIGHT)
    height = int(_PAD_TOP + row_height * len(rows) + 22)
    parts = [
        f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title)}"><title>{escape(title)}</title>'
    ]
    for index, (label, bars) in enumerate(rows):
        y = _PAD_TOP + row_height * index
        parts.append(
            f'<text x="{label_w - 6}" y="{y + row_height - 5:.1f}" text-anchor="end">'
            f"{escape(label)}</text>"
        )
        for bar in bars:
            if not (math.isfinite(bar.start) and math.isfinite(bar.end)):
                continue
            x0, x1 = scale(max(bar.start, 0.0)), scale(max(bar.end, bar.start, 0.0))
            colour = _BAR_COLOURS.get(bar.kind, "#888")
            parts.append(
                f'<rect class="bar {escape(bar.kind)}" x="{x0:.1f}" y="{y + 2:.1f}" '
                f'width="{max(x1 - x0, 1.0):.1f}" height="{row_height - 4}" fill="{colour}">'
                f"<title>{escape(bar.label)}</title></rect>"
            )
    axis_y = _PAD_TOP + row_height * len(rows) + 14
    parts.append(
        f'<text class="tick" x="{label_w:.1f}" y="{axis_y:.1f}">0 s</text>'
        f'<text class="tick" x="{scale.end:.1f}" y="{axis_y:.1f}" text-anchor="end">'
        f"{nice_number(scale.high)} s</text></svg>"
    )
    return "".join(parts)
