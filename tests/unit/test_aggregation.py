"""Streaming weighted aggregation of region deltas and the shared delta arithmetic."""

import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.aggregation import weighted as aggregation
from coordinator.aggregation.weighted import (
    AggregationError,
    WeightedSum,
    aggregate,
    regions_at_once,
)
from geofed.codec.host_threads import usable_cpus
from geofed.deltas import (
    DeltaError,
    apply_update,
    feedback_residual,
    pseudo_gradient,
    update_to_publish,
)
from tests.support.aggregation import SPECS, FakePiece, assert_bit_identical, delta, pieces, source


def test_weighted_mean_equals_direct_computation() -> None:
    weights = {"eu-west": 1000.0, "us-east": 3000.0, "ap-south": 500.0}
    deltas = {r: delta(i) for i, r in enumerate(weights)}
    total = WeightedSum(SPECS)
    for region in sorted(weights):
        total.add_region(region, weights[region], pieces(deltas[region]))
    mean = total.mean()
    w_sum = sum(weights.values())
    for name, shape in SPECS.items():
        expected = sum(weights[r] * deltas[r][name].double() for r in weights) / w_sum
        assert mean[name].shape == shape
        assert mean[name].dtype == torch.float32
        torch.testing.assert_close(mean[name].double(), expected, rtol=1e-6, atol=1e-7)
    assert total.regions == ("ap-south", "eu-west", "us-east")
    assert total.total_weight == 4500.0


def test_fp32_accumulation_error_is_far_below_int8_quantization_error() -> None:
    # 32 regions, weights in the billions of tokens: fp32 vs an fp64 sum.
    specs = {"w": (4096,)}
    weights = [float(10**9 + 7919 * i) for i in range(32)]
    deltas = [delta(100 + i, specs)["w"] for i in range(32)]
    total = WeightedSum(specs)
    for i, d in enumerate(deltas):
        total.add_region(f"r{i:02d}", weights[i], pieces({"w": d}, chunk=512))
    exact = sum(w * d.double() for w, d in zip(weights, deltas, strict=True)) / sum(weights)
    error = (total.mean()["w"].double() - exact).abs().max().item()
    int8_step = max(d.abs().max().item() for d in deltas) / 127
    assert error < int8_step / 1000, (error, int8_step)


def test_piece_order_within_a_region_does_not_matter() -> None:
    d = delta(1)
    a, b = WeightedSum(SPECS), WeightedSum(SPECS)
    a.add_region("eu-west", 2.0, pieces(d, chunk=3))
    b.add_region("eu-west", 2.0, pieces(d, chunk=5, shuffle_seed=7))
    assert_bit_identical(a.mean(), b.mean())


def test_region_order_changes_bits_so_the_canonical_order_matters() -> None:
    # Proof that fp32 addition order is visible in the result, so the tests below
    # of the canonical order guard something real.
    specs = {"w": (4096,)}
    deltas = {r: delta(i, specs) for i, r in enumerate(["aa", "bb", "cc", "dd"])}
    weights = {"aa": 3.0, "bb": 7.0, "cc": 11.0, "dd": 13.0}
    forward, backward = WeightedSum(specs), WeightedSum(specs)
    for r in sorted(deltas):
        forward.add_region(r, weights[r], pieces(deltas[r], chunk=512))
    for r in sorted(deltas, reverse=True):
        backward.add_region(r, weights[r], pieces(deltas[r], chunk=512))
    assert not torch.equal(forward.mean()["w"], backward.mean()["w"])


@settings(max_examples=30, deadline=None)
@given(
    arrival=st.permutations(["ap-south", "eu-central", "eu-west", "us-east", "us-west"]),
    shuffle=st.integers(0, 1000),
)
def test_aggregate_is_bit_identical_whatever_order_deltas_arrived_in(arrival, shuffle) -> None:
    weights = {
        "ap-south": 1.5e6,
        "eu-central": 2.25e6,
        "eu-west": 1e6,
        "us-east": 3e6,
        "us-west": 7e5,
    }
    deltas = {r: delta(i) for i, r in enumerate(sorted(weights))}
    canonical = aggregate(SPECS, {r: (weights[r], source(deltas[r])) for r in sorted(weights)})
    # Sources handed over in arrival order, pieces in a different order and chunking.
    received = {r: (weights[r], source(deltas[r], chunk=4, shuffle_seed=shuffle)) for r in arrival}
    assert_bit_identical(aggregate(SPECS, received), canonical)


def test_aggregate_replays_a_recorded_arrival_order() -> None:
    deltas = {r: delta(i) for i, r in enumerate(["cc", "aa", "bb"])}
    live = WeightedSum(SPECS)
    for r in ["cc", "aa", "bb"]:  # as they arrived
        live.add_region(r, 2.0, pieces(deltas[r]))
    sources = {r: (2.0, source(deltas[r])) for r in sorted(deltas)}
    assert_bit_identical(aggregate(SPECS, sources, order=live.regions), live.mean())
    with pytest.raises(
        AggregationError, match=r"not a permutation of the sources \['aa', 'bb', 'cc'\]"
    ):
        aggregate(SPECS, sources, order=["aa", "bb"])
    with pytest.raises(AggregationError, match="not a permutation"):
        aggregate(SPECS, sources, order=["aa", "aa", "bb"])


def test_aggregate_calls_each_source_once_in_turn() -> None:
    calls: list[str] = []

    def source(region: str):
        def produce():
            calls.append(region)
            return pieces(delta(len(calls)))

        return produce

    aggregate(SPECS, {r: (1.0, source(r)) for r in ["zz", "mm", "aa"]}, workers=1)
    assert calls == ["aa", "mm", "zz"]


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_regions_decoded_at_once_give_the_same_bits(workers: int) -> None:
    regions = [f"r{i}" for i in range(7)]
    deltas = {r: delta(i) for i, r in enumerate(regions)}
    arrival = ["r3", "r0", "r6", "r1", "r5", "r2", "r4"]
    sources = {r: (1.0 + i / 7, source(deltas[r], chunk=5)) for i, r in enumerate(regions)}
    one_at_a_time = aggregate(SPECS, sources, arrival, workers=1)
    assert_bit_identical(aggregate(SPECS, sources, arrival, workers=workers), one_at_a_time)
    assert_bit_identical(aggregate(SPECS, sources, arrival), one_at_a_time)


def test_aggregate_decodes_at_most_workers_regions_at_once() -> None:
    lock = threading.Lock()
    both_first = threading.Barrier(2, timeout=10)  # breaks unless the first two overlap
    running = peak = 0
    calls: list[str] = []

    def source(index: int):
        def produce():
            nonlocal running, peak
            with lock:
                calls.append(f"r{index}")
                running += 1
                peak = max(peak, running)
            if index < 2:
                both_first.wait()
            time.sleep(0.005)
            out = pieces(delta(index))
            with lock:
                running -= 1
            return out

        return produce

    aggregate(SPECS, {f"r{i}": (1.0, source(i)) for i in range(6)}, workers=2)
    assert sorted(calls) == [f"r{i}" for i in range(6)]  # each source called once
    assert peak == 2


def test_a_failing_region_decoded_ahead_fails_the_aggregate() -> None:
    def broken():
        yield from pieces(delta(2))[:3]
        raise RuntimeError("frame 4 failed its hash check")

    sources = {"aa": (1.0, source(delta(1))), "bb": (1.0, broken), "cc": (1.0, source(delta(3)))}
    with pytest.raises(RuntimeError, match="frame 4"):
        aggregate(SPECS, sources, workers=3)
    sources["bb"] = (1.0, lambda: _with_bad_piece("gap"))
    with pytest.raises(AggregationError, match=r"region 'bb', tensor 'w': elements \[16, 24\)"):
        aggregate(SPECS, sources, workers=3)


def test_regions_at_once_is_bounded_by_regions_cpus_and_memory() -> None:
    assert regions_at_once(1, 4) == 1
    assert 1 <= regions_at_once(64, 4) <= min(64, usable_cpus(), 2)
    assert regions_at_once(64, 1 << 62) == 1  # no room for a staged copy: one at a time
    # With the running sum, never more than 3 model-sized copies, whatever the regions.
    assert regions_at_once(8, 1 << 20, cpus=16, available=10 << 30) == 2
    # Half of 10 GiB holds no 6 GiB copy.
    assert regions_at_once(8, 6 << 30, cpus=16, available=10 << 30) == 1
    assert regions_at_once(32, 1 << 20, cpus=1, available=10 << 30) == 1
    assert regions_at_once(32, 1 << 30, cpus=16, available=None) == 2


def test_available_memory_is_known_on_linux() -> None:
    available = aggregation.available_memory()
    if Path("/proc/meminfo").exists():
        assert available is not None
        assert available > 0


def _with_bad_piece(kind: str) -> list[FakePiece]:
    good = pieces(delta(9), chunk=8)
    w_pieces = [p for p in good if p.name == "w"]
    others = [p for p in good if p.name != "w"]
    if kind == "gap":
        return others + w_pieces[:2] + w_pieces[3:]
    if kind == "gap_at_end":
        return others + w_pieces[:-1]
    if kind == "overlap":
        extra = FakePiece("w", 4, 8, torch.zeros(8))
        return [*others, *w_pieces, extra]
    if kind == "unknown":
        return [*good, FakePiece("ghost", 0, 1, torch.zeros(1))]
    if kind == "out_of_range":
        return [*good, FakePiece("b", 3, 4, torch.zeros(4))]
    if kind == "negative":
        return [*good, FakePiece("b", -1, 1, torch.zeros(1))]
    if kind == "dtype":
        return [*others, FakePiece("w", 0, 42, torch.zeros(42, dtype=torch.float64))]
    if kind == "length":
        return [*others, FakePiece("w", 0, 42, torch.zeros(41))]
    if kind in ("nan", "neg_inf"):
        values = torch.zeros(42)
        values[17] = float("nan") if kind == "nan" else float("-inf")
        return [*others, FakePiece("w", 0, 42, values)]
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("gap", r"region 'us-east', tensor 'w': elements \[16, 24\) are missing \(gap\)"),
        ("gap_at_end", r"tensor 'w': elements \[40, 42\) are missing \(gap\)"),
        ("overlap", r"tensor 'w': elements \[4, 8\) are covered more than once \(overlap\)"),
        ("unknown", r"region 'us-east': unknown tensor 'ghost'"),
        ("out_of_range", r"tensor 'b': slice \[3, 7\) is outside its 5 elements"),
        ("negative", r"tensor 'b': slice \[-1, 0\) is outside its 5 elements"),
        ("dtype", r"tensor 'w': values must be a float32 tensor, not torch.float64"),
        ("length", r"tensor 'w': values have shape \(41,\), expected \(42,\)"),
        ("nan", r"tensor 'w': slice \[0, 42\) contains NaN or Inf"),
        ("neg_inf", r"tensor 'w': slice \[0, 42\) contains NaN or Inf"),
    ],
)
def test_bad_region_is_refused_and_leaves_the_sum_unchanged(kind, needle) -> None:
    total, reference = WeightedSum(SPECS), WeightedSum(SPECS)
    for ws in (total, reference):
        ws.add_region("eu-west", 3.0, pieces(delta(1)))
    with pytest.raises(AggregationError, match=needle):
        total.add_region("us-east", 5.0, _with_bad_piece(kind))
    assert total.regions == ("eu-west",)
    assert total.total_weight == 3.0
    # The same region may then be added properly, and the result is as if the bad
    # attempt never happened.
    for ws in (total, reference):
        ws.add_region("us-east", 5.0, pieces(delta(2)))
    assert_bit_identical(total.mean(), reference.mean())


def test_failing_piece_stream_leaves_the_sum_unchanged() -> None:
    total = WeightedSum(SPECS)
    total.add_region("eu-west", 1.0, pieces(delta(1)))
    before = total.mean()

    def corrupt_stream():
        yield from pieces(delta(2))[:3]
        raise RuntimeError("frame 4 failed its hash check")

    with pytest.raises(RuntimeError, match="frame 4"):
        total.add_region("us-east", 1.0, corrupt_stream())
    assert total.regions == ("eu-west",)
    assert_bit_identical(total.mean(), before)


@pytest.mark.parametrize(
    ("region", "weight", "needle"),
    [
        ("eu-west", 1.0, "region 'eu-west' was already added"),
        ("us-east", 0.0, "weight must be > 0, got 0.0"),
        ("us-east", -3.0, "weight must be > 0, got -3.0"),
        ("us-east", float("nan"), "weight must be > 0, got nan"),
        ("us-east", float("inf"), "weight must be finite"),
        ("Bad_Name", 1.0, "invalid region 'Bad_Name'"),
    ],
)
def test_bad_region_arguments(region, weight, needle) -> None:
    total = WeightedSum(SPECS)
    total.add_region("eu-west", 1.0, pieces(delta(1)))
    with pytest.raises(AggregationError, match=needle):
        total.add_region(region, weight, pieces(delta(2)))
    assert total.regions == ("eu-west",)


def test_bad_specs_and_empty_mean() -> None:
    with pytest.raises(AggregationError, match="specs is empty"):
        WeightedSum({})
    with pytest.raises(AggregationError, match=r"tensor 'w' has an invalid shape \(3, -1\)"):
        WeightedSum({"w": (3, -1)})
    with pytest.raises(AggregationError, match="no region was added"):
        WeightedSum(SPECS).mean()


def test_empty_tensor_needs_no_pieces() -> None:
    specs = {"w": (3,), "empty": (0, 4)}
    total = WeightedSum(specs)
    total.add_region("eu-west", 1.0, [FakePiece("w", 0, 3, torch.ones(3))])
    mean = total.mean()
    assert mean["empty"].shape == (0, 4)
    assert torch.equal(mean["w"], torch.ones(3))


def test_memory_stays_within_twice_the_model() -> None:
    specs = {"w": (256, 64), "b": (64,)}
    model_bytes = 4 * (256 * 64 + 64)
    total = WeightedSum(specs)
    assert total.nbytes == model_bytes  # the sum only, until the first region
    for i in range(6):
        total.add_region(f"r{i}", 1.0, pieces(delta(i, specs), chunk=1000))
        assert total.nbytes == 2 * model_bytes  # sum + one reusable scratch, any region count
    mean = total.mean()
    result_bytes = sum(t.numel() * 4 for t in mean.values())
    assert total.nbytes + result_bytes == 2 * model_bytes  # scratch freed before the result


def test_thread_count_does_not_change_a_bit() -> None:
    specs = {"w": (200_003,)}  # above torch's parallel grain, odd length for scalar tails
    deltas = {r: delta(i, specs) for i, r in enumerate(["aa", "bb", "cc"])}
    sources = {r: (1.0 + i / 3, source(deltas[r], chunk=65536)) for i, r in enumerate(deltas)}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = aggregate(specs, sources)
        torch.set_num_threads(4)
        multi = aggregate(specs, sources)
    finally:
        torch.set_num_threads(threads)
    assert_bit_identical(single, multi)


def test_pseudo_gradient_and_apply_update() -> None:
    base, local = delta(1), delta(2)
    pg = pseudo_gradient(base, local)
    for n in SPECS:
        assert torch.equal(pg[n], base[n] - local[n])
    upd = apply_update(base, pg)
    for n in SPECS:
        assert torch.equal(upd[n], base[n] + pg[n])
    assert base["w"].data_ptr() != upd["w"].data_ptr()  # new tensors, inputs untouched


@pytest.mark.parametrize(
    ("right", "needle"),
    [
        ({"w": torch.zeros(6, 7), "b": torch.zeros(5)}, r"only on the left \['s'\]"),
        (
            {"w": torch.zeros(7, 6), "b": torch.zeros(5), "s": torch.zeros(())},
            r"shapes \(6, 7\) and \(7, 6\)",
        ),
        (
            {
                "w": torch.zeros(6, 7),
                "b": torch.zeros(5, dtype=torch.float16),
                "s": torch.zeros(()),
            },
            "'b' must be float32",
        ),
    ],
)
def test_elementwise_ops_refuse_mismatched_tensors(right, needle) -> None:
    with pytest.raises(DeltaError, match=needle):
        pseudo_gradient(delta(1), right)


def fake_lossy_codec(
    update: dict[str, torch.Tensor], step: float = 1 / 64
) -> dict[str, torch.Tensor]:
    """Stands in for encode-then-decode: round to a coarse grid."""
    return {n: torch.round(t / step) * step for n, t in update.items()}


def test_published_update_with_error_feedback_keeps_everyone_in_sync() -> None:
    coordinator = delta(1)
    region = {n: t.clone() for n, t in coordinator.items()}
    residual: dict[str, torch.Tensor] | None = None
    intended_total = {n: torch.zeros(s, dtype=torch.float64) for n, s in SPECS.items()}
    for r in range(6):
        target = {n: t + 0.01 * delta(50 + r)[n] for n, t in coordinator.items()}
        for n in SPECS:
            intended_total[n] += (target[n] - coordinator[n]).double()
        intended = update_to_publish(coordinator, target, residual)
        decoded = fake_lossy_codec(intended)
        residual = feedback_residual(intended, decoded)
        coordinator = apply_update(coordinator, decoded)
        region = apply_update(region, decoded)  # what a region does with the download
        assert_bit_identical(coordinator, region)
        for n in SPECS:
            assert residual[n].abs().max().item() <= 1 / 128 + 1e-6
    assert residual is not None
    # Error feedback: what was applied is what was intended, up to the last residual.
    start = delta(1)
    for n in SPECS:
        applied = coordinator[n].double() - start[n].double()
        torch.testing.assert_close(
            applied, intended_total[n] - residual[n].double(), rtol=0, atol=1e-5
        )


def test_fold_parts_cover_every_element_once_in_bounded_jobs() -> None:
    sums = {n: torch.zeros(k) for n, k in [("a", 25), ("b", 3), ("c", 0), ("d", 7), ("e", 10)]}
    values = {n: torch.arange(t.numel(), dtype=torch.float32) for n, t in sums.items()}
    parts = aggregation._fold_parts(sums, values, part_elements=10)
    assert all(sum(total.numel() for total, _ in part) <= 10 for part in parts)
    for part in parts:
        for total, added in part:
            total += 1
            assert total.shape == added.shape
    assert all(bool((t == 1).all()) for t in sums.values())  # each element exactly once
    assert len(parts) == 5  # 10 | 10 | 5+3 | 7 | 10


def test_folding_in_many_parts_gives_the_same_bits() -> None:
    # Larger than FOLD_PART: the fold is cut into parts folded side by side.
    specs = {"w": (30000, 37), "b": (37,), "s": ()}
    assert aggregation.FOLD_PART < 30000 * 37
    deltas = {r: delta(i, specs) for i, r in enumerate(["aa", "bb", "cc"])}
    sources = {r: (1.0 + i / 3, source(deltas[r], chunk=1 << 18)) for i, r in enumerate(deltas)}
    whole = aggregate(specs, sources, workers=1)
    assert_bit_identical(aggregate(specs, sources, workers=1), whole)
    assert_bit_identical(aggregate(specs, sources, workers=3), whole)
    # The reference arithmetic: mul then add, in region order, then one division.
    expected = {n: torch.zeros(s) for n, s in specs.items()}
    for i, r in enumerate(["aa", "bb", "cc"]):
        for n in specs:
            expected[n] += deltas[r][n] * (1.0 + i / 3)
    total = sum(1.0 + i / 3 for i in range(3))
    assert_bit_identical(whole, {n: t / total for n, t in expected.items()})
