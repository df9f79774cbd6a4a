"""The status page's SVG charts: scaling with 0, 1 and many points, and escaping."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET

from coordinator.api.ui.svg import Bar, Scale, Series, bar_rows, line_chart, thin

SVG = "{http://www.w3.org/2000/svg}"


def _parse(markup: str) -> ET.Element:
    return ET.fromstring(markup)


def _circles(root: ET.Element) -> list[tuple[float, float]]:
    return [(float(c.get("cx", "")), float(c.get("cy", ""))) for c in root.iter(f"{SVG}circle")]


def _inside(root: ET.Element, points: list[tuple[float, float]]) -> bool:
    width, height = float(root.get("width", "")), float(root.get("height", ""))
    return all(0 <= x <= width and 0 <= y <= height for x, y in points)


def test_no_points_says_so_and_draws_nothing() -> None:
    root = _parse(line_chart([Series("loss", [])], title="empty"))
    assert _circles(root) == []
    assert not list(root.iter(f"{SVG}polyline"))
    assert any(t.text == "no data yet" for t in root.iter(f"{SVG}text"))


def test_one_point_is_a_dot_in_the_middle() -> None:
    root = _parse(line_chart([Series("loss", [(3.0, 2.5)])], title="one"))
    (x, y), *rest = _circles(root)
    assert rest == []
    assert not list(root.iter(f"{SVG}polyline"))  # a line needs two points
    assert _inside(root, [(x, y)])
    frame = next(root.iter(f"{SVG}rect"))
    left, width = float(frame.get("x", "")), float(frame.get("width", ""))
    top, height = float(frame.get("y", "")), float(frame.get("height", ""))
    assert math.isclose(x, left + width / 2, abs_tol=0.1)
    assert math.isclose(y, top + height / 2, abs_tol=0.1)


def test_many_points_span_the_plot_with_lower_values_lower() -> None:
    points = [(float(r), 5.0 - 0.3 * r) for r in range(50)]
    root = _parse(line_chart([Series("loss", points)], title="many"))
    drawn = _circles(root)
    assert len(drawn) == 50
    assert _inside(root, drawn)
    xs = [x for x, _ in drawn]
    assert xs == sorted(xs)
    assert xs[0] < xs[-1]
    ys = [y for _, y in drawn]
    assert ys == sorted(ys)  # SVG y grows downwards: a falling loss goes down the page
    (line,) = root.iter(f"{SVG}polyline")
    assert len(line.get("points", "").split()) == 50


def test_series_share_the_axes_and_non_finite_values_are_left_out() -> None:
    root = _parse(
        line_chart(
            [Series("a", [(0, 1.0), (1, math.nan), (2, 3.0)]), Series("b", [(0, 2.0)])],
            title="two",
        )
    )
    by_series: dict[str, int] = {}
    for circle in root.iter(f"{SVG}circle"):
        name = circle.get("data-series", "")
        by_series[name] = by_series.get(name, 0) + 1
    assert by_series == {"a": 2, "b": 1}
    assert _inside(root, _circles(root))


def test_constant_values_do_not_divide_by_zero() -> None:
    scale = Scale.fit([2.0, 2.0, 2.0], 100.0, 0.0)
    assert scale.low < 2.0 < scale.high
    assert math.isclose(scale(2.0), 50.0)
    assert Scale.fit([], 0.0, 10.0)(0.5) == 5.0


def test_names_and_titles_are_escaped() -> None:
    hostile = '"><script>alert(1)</script>'
    markup = line_chart([Series(hostile, [(0, 1.0), (1, 2.0)])], title=hostile)
    assert "<script" not in markup
    root = _parse(markup)  # still well-formed
    assert any(c.get("data-series") == hostile for c in root.iter(f"{SVG}circle"))
    timeline = bar_rows([(hostile, [Bar(0, 1, "work", hostile)])], title=hostile)
    assert "<script" not in timeline
    _parse(timeline)


def test_timeline_bars_share_one_axis() -> None:
    root = _parse(
        bar_rows(
            [
                ("r0 a", [Bar(0, 2, "work", "")]),
                ("r0 b", [Bar(0, 4, "work", ""), Bar(4, 8, "wait", "")]),
            ],
            title="t",
        )
    )
    bars = [r for r in root.iter(f"{SVG}rect") if "bar" in r.get("class", "")]
    widths = [float(b.get("width", "")) for b in bars]
    assert math.isclose(widths[1], 2 * widths[0], rel_tol=0.02)
    assert math.isclose(widths[2], widths[1], rel_tol=0.02)
    assert re.search(r">8 s<", ET.tostring(root, encoding="unicode"))


def test_a_long_series_is_thinned_to_a_bounded_size_keeping_both_ends() -> None:
    points = [(float(r), 1.0 / (r + 1)) for r in range(5000)]
    root = _parse(line_chart([Series("loss", points)], title="long", max_points=100))
    drawn = _circles(root)
    assert len(drawn) == 100
    kept = thin(points, 100)
    assert kept[0] == points[0]
    assert kept[-1] == points[-1]
    assert [x for x, _ in kept] == sorted({x for x, _ in kept})
    assert thin(points[:3], 100) == points[:3]
