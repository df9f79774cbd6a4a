"""Deltas folded as they are accepted give the bits of the sum decoded at publication."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator

import pytest
import torch

from coordinator.aggregation.accumulator import RoundAccumulator
from coordinator.aggregation.config import AggregationConfig
from coordinator.aggregation.robust import folded, folds_on_arrival
from coordinator.aggregation.weighted import (
    AggregationError,
    DeltaStager,
    Feed,
    PieceLike,
    StagedDelta,
    WeightedSum,
    aggregate,
)
from geofed.codec import Piece

SHAPES = {"w": (4, 6), "b": (6,)}


def _delta(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def _pieces(delta: dict[str, torch.Tensor], size: int = 5) -> Iterator[Piece]:
    for name, tensor in delta.items():
        flat = tensor.reshape(-1)
        for offset in range(0, flat.numel(), size):
            values = flat[offset : offset + size].clone()
            yield Piece(name=name, offset=offset, count=values.numel(), values=values)


def _staged(region: str, delta: dict[str, torch.Tensor]) -> StagedDelta:
    stager = DeltaStager(region, SHAPES)
    for piece in _pieces(delta):
        stager.add(piece)
    return stager.finish()


def fed(pieces: Iterable[Piece]) -> Feed:
    """A feed of ``pieces``, taken on the calling thread."""

    def feed(consume: Callable[[PieceLike], None]) -> None:
        for piece in pieces:
            consume(piece)

    return feed


def _decoding(delta: dict[str, torch.Tensor]) -> Feed:
    """What the engine hands a fold: a verified delta, decoded again when fed."""
    return fed(_pieces(delta))


DELTAS = {"us-east": _delta(1), "eu-west": _delta(2), "ap-south": _delta(3)}
TOKENS = {"us-east": 300.0, "eu-west": 100.0, "ap-south": 7.0}
ARRIVALS = ["us-east", "ap-south", "eu-west"]


def _decoded_mean(order: list[str]) -> dict[str, torch.Tensor]:
    sources = {r: (TOKENS[r], lambda r=r: _pieces(DELTAS[r])) for r in order}
    return aggregate(SHAPES, sources, order)


def test_folding_on_arrival_gives_the_bits_of_decoding_in_arrival_order() -> None:
    accumulator = RoundAccumulator((3, 1000.0), SHAPES)
    for region in ARRIVALS:
        accumulator.fold(region, TOKENS[region], _decoding(DELTAS[region]))
    held, why = accumulator.take(ARRIVALS, TOKENS)
    assert held is not None, why
    folded_mean = held.take_mean()
    expected = _decoded_mean(ARRIVALS)
    for name in SHAPES:
        assert torch.equal(folded_mean[name], expected[name])


def test_the_order_changes_the_bits_so_it_must_be_the_recorded_one() -> None:
    # Why the arrival order is recorded with the round: sorted order is another sum.
    first = _decoded_mean(ARRIVALS)
    other = _decoded_mean(sorted(ARRIVALS))
    assert any(not torch.equal(first[n], other[n]) for n in SHAPES)


def test_a_sum_that_is_not_the_rounds_is_refused_with_its_reason() -> None:
    accumulator = RoundAccumulator((3, 1000.0), SHAPES)
    accumulator.fold("us-east", TOKENS["us-east"], _decoding(DELTAS["us-east"]))
    accumulator.fold("eu-west", TOKENS["eu-west"], _decoding(DELTAS["eu-west"]))
    held, why = accumulator.take(["eu-west", "us-east"], TOKENS)
    assert held is None
    assert "folded ['us-east', 'eu-west']" in why
    held, why = accumulator.take(["us-east", "eu-west"], {**TOKENS, "eu-west": 99.0})
    assert held is None
    assert "weights" in why
    held, _ = accumulator.take(["us-east", "eu-west"], TOKENS)
    assert held is not None
    again, why = accumulator.take(["us-east", "eu-west"], TOKENS)
    assert again is None
    assert why == "handed over"


def test_a_failed_fold_abandons_the_sum() -> None:
    accumulator = RoundAccumulator((3, 1000.0), SHAPES)
    accumulator.fold("us-east", TOKENS["us-east"], _decoding(DELTAS["us-east"]))
    with pytest.raises(AggregationError, match="already added"):
        accumulator.fold("us-east", 1.0, _decoding(DELTAS["us-east"]))
    held, why = accumulator.take(["us-east"], TOKENS)
    assert held is None
    assert "folding us-east's delta failed" in why
    # Later folds are ignored: the publisher decodes the round instead.
    accumulator.fold("eu-west", TOKENS["eu-west"], _decoding(DELTAS["eu-west"]))
    assert accumulator.take(["us-east", "eu-west"], TOKENS)[0] is None


def test_a_fold_that_fails_part_way_abandons_the_sum_it_half_added_to() -> None:
    accumulator = RoundAccumulator((3, 1000.0), SHAPES)
    accumulator.fold("us-east", TOKENS["us-east"], _decoding(DELTAS["us-east"]))

    def broken() -> Iterator[Piece]:
        pieces = _pieces(DELTAS["eu-west"])
        yield next(pieces)
        raise OSError("the stored stream can no longer be read")

    with pytest.raises(OSError, match="no longer be read"):
        accumulator.fold("eu-west", TOKENS["eu-west"], fed(broken()))
    held, why = accumulator.take(["us-east", "eu-west"], TOKENS)
    assert held is None
    assert "folding eu-west's delta failed" in why


def test_a_verified_delta_that_decodes_short_is_refused_and_abandons_the_sum() -> None:
    total = WeightedSum(SHAPES)
    short = list(_pieces(DELTAS["us-east"]))[:-1]
    with pytest.raises(AggregationError, match="other than their elements"):
        total.add_verified("us-east", 1.0, fed(short))
    assert total.regions == ()
    accumulator = RoundAccumulator((3, 1000.0), SHAPES)
    with pytest.raises(AggregationError):
        accumulator.fold("us-east", 1.0, fed(short))
    assert accumulator.take(["us-east"], {"us-east": 1.0})[0] is None


def test_folding_verified_pieces_gives_the_bits_of_folding_them_staged() -> None:
    staged, verified = WeightedSum(SHAPES), WeightedSum(SHAPES)
    for region in ARRIVALS:
        staged.add_staged(region, TOKENS[region], _staged(region, DELTAS[region]))
        verified.add_verified(region, TOKENS[region], fed(_pieces(DELTAS[region])))
    expected, got = staged.take_mean(), verified.take_mean()
    for name in SHAPES:
        assert torch.equal(got[name], expected[name])


def test_taking_the_sum_never_waits_for_a_fold_still_running() -> None:
    accumulator = RoundAccumulator((3, 1000.0), SHAPES)
    started, release = threading.Event(), threading.Event()

    def slow() -> Iterator[Piece]:  # a fold whose await was cancelled, still decoding
        started.set()
        release.wait(10)
        yield from _pieces(DELTAS["us-east"])

    folding = threading.Thread(
        target=accumulator.fold, args=("us-east", TOKENS["us-east"], fed(slow())), daemon=True
    )
    folding.start()
    assert started.wait(10)
    held, why = accumulator.take(["us-east"], TOKENS)
    assert (held, why) == (None, "a fold is still running")
    release.set()
    folding.join(10)


def test_an_abandoned_sum_is_never_handed_over() -> None:
    accumulator = RoundAccumulator((3, 1000.0), SHAPES)
    accumulator.fold("us-east", TOKENS["us-east"], _decoding(DELTAS["us-east"]))
    accumulator.abandon("folding eu-west's delta was cancelled")
    held, why = accumulator.take(["us-east"], TOKENS)
    assert held is None
    assert why == "folding eu-west's delta was cancelled"


def test_a_stager_refuses_gaps_and_overlaps_and_a_sum_refuses_a_stranger() -> None:
    stager = DeltaStager("us-east", SHAPES)
    pieces = list(_pieces(DELTAS["us-east"]))
    for piece in pieces[1:]:
        stager.add(piece)
    with pytest.raises(AggregationError, match="gap"):
        stager.finish()
    stager = DeltaStager("us-east", SHAPES)
    for piece in [*pieces, pieces[0]]:
        stager.add(piece)
    with pytest.raises(AggregationError, match="overlap"):
        stager.finish()
    total = WeightedSum(SHAPES)
    with pytest.raises(AggregationError, match="offered as"):
        total.add_staged("eu-west", 1.0, _staged("us-east", DELTAS["us-east"]))
    assert total.regions == ()


def test_only_a_plain_mean_folds_on_arrival() -> None:
    assert folds_on_arrival(AggregationConfig())
    assert not folds_on_arrival(AggregationConfig(norm_check="clip"))
    assert not folds_on_arrival(AggregationConfig(rule="median"))
    with pytest.raises(AggregationError, match="cannot be folded"):
        folded({}, ["us-east"], AggregationConfig(rule="trimmed_mean"))
    combined = folded({}, ["us-east", "eu-west"], AggregationConfig())
    assert [v.action for v in combined.verdicts] == ["kept", "kept"]
