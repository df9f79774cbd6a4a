"""geofed.fragments: how a streaming job's model is split, and which round syncs what."""

from __future__ import annotations

import pytest

from geofed.fragments import FragmentError, fragment_plan, round_fragment


def test_every_tensor_is_in_exactly_one_fragment_in_the_callers_order() -> None:
    shapes = {
        "emb": (100, 8),
        "a.w": (8, 8),
        "a.b": (8,),
        "b.w": (8, 8),
        "b.b": (8,),
        "head": (8, 4),
    }
    plan = fragment_plan(shapes, 3)
    names = [name for fragment in plan.fragments for name in fragment]
    assert sorted(names) == sorted(shapes)
    for fragment in plan.fragments:
        assert list(fragment) == [name for name in shapes if name in fragment]
    assert sum(plan.elements) == 800 + 64 + 8 + 64 + 8 + 32


def test_the_split_balances_elements_largest_first() -> None:
    shapes = {f"t{i}": size for i, size in enumerate([10, 10, 10, 10, 1, 1, 1, 1])}
    plan = fragment_plan(shapes, 4)
    assert plan.elements == (11, 11, 11, 11)
    assert plan.largest_share() == pytest.approx(0.25)


def test_the_split_does_not_depend_on_the_order_the_shapes_come_in() -> None:
    shapes = {"x": (3, 3), "y": (5,), "z": (2, 2), "w": (7,), "v": (1,)}
    reordered = dict(reversed(list(shapes.items())))
    a = fragment_plan(shapes, 2)
    b = fragment_plan(reordered, 2)
    assert [set(f) for f in a.fragments] == [set(f) for f in b.fragments]


def test_round_r_synchronizes_fragment_r_mod_f() -> None:
    plan = fragment_plan({"a": 4, "b": 3, "c": 2}, 3)
    assert [round_fragment(r, 3) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert plan.names(0) == plan.fragments[0]
    assert plan.names(4) == plan.fragments[1]


def test_a_single_fragment_is_the_whole_model() -> None:
    shapes = {"a": (2,), "b": (3,)}
    assert fragment_plan(shapes, 1).names(5) == ("a", "b")


@pytest.mark.parametrize("fragments", [0, -1])
def test_fewer_than_one_fragment_is_refused(fragments: int) -> None:
    with pytest.raises(FragmentError, match="fragments must be >= 1"):
        fragment_plan({"a": 1}, fragments)


def test_more_fragments_than_tensors_is_refused_with_the_counts() -> None:
    with pytest.raises(FragmentError, match="model of 2 tensors cannot be split into 3"):
        fragment_plan({"a": 1, "b": 2}, 3)
