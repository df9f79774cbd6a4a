"""CharLMTask: deterministic models and data, region/rank splits, evaluation, training."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from geofed.examples.charlm import CharLMOptions, CharLMTask, TokenBatch
from geofed.examples.charlm.sampling import SamplingError
from geofed.params import count_parameters, parameters_vector_hash
from geofed.task import DataShard, TaskOptionsError, load_task
from tests.support.fake_stdlib import FAKE_UNITS, make_fake_stdlib

SPEC = "geofed.examples.charlm:CharLMTask"


@pytest.fixture(scope="module")
def fake_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fake_stdlib(tmp_path_factory.mktemp("stdlib"))


@pytest.fixture(scope="module")
def small(fake_root: Path) -> CharLMTask:
    """A tiny model on the fake tree: 17-byte windows, 4 per batch."""
    options = CharLMOptions(
        d_model=16, n_layers=1, n_heads=2, seq_len=16, batch_size=4, corpus_dir=fake_root
    )
    return CharLMTask(options)


@pytest.fixture(scope="module")
def stdlib_task() -> CharLMTask:
    return CharLMTask()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Train as workers do; two threads on two shared cores slow down tenfold under load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _shard(region_index: int = 0, rank: int = 0, world_size: int = 2, seed: int = 0) -> DataShard:
    return DataShard(f"region-{region_index}", region_index, 3, rank, world_size, seed)


def _take(task: CharLMTask, shard: DataShard, start: int, count: int) -> list[TokenBatch]:
    return list(itertools.islice(task.batches(shard, start), count))


def _same(a: list[TokenBatch], b: list[TokenBatch]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
        for x, y in zip(a, b, strict=True)
    )


def test_load_task_by_spec_with_options(fake_root: Path) -> None:
    task = load_task(SPEC, {"d_model": 32, "n_heads": 4, "corpus_dir": str(fake_root)})
    assert isinstance(task, CharLMTask)
    assert task.options.d_model == 32
    assert task.options.corpus_dir == fake_root


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"d_model": 30, "n_heads": 4}, "d_model 30 is not divisible by n_heads 4"),
        ({"seq_len": 1}, "seq_len: Input should be greater than or equal to 2"),
        ({"lr": 0}, "lr: Input should be greater than 0"),
        ({"n_layer": 2}, "n_layer: Extra inputs are not permitted"),
    ],
)
def test_bad_options_are_named(options: dict[str, object], message: str) -> None:
    with pytest.raises(TaskOptionsError, match=message):
        load_task(SPEC, options)


def test_same_seed_same_model_different_seed_different_model(stdlib_task: CharLMTask) -> None:
    first = parameters_vector_hash(stdlib_task.build_model(seed=3))
    assert parameters_vector_hash(stdlib_task.build_model(seed=3)) == first
    assert parameters_vector_hash(stdlib_task.build_model(seed=4)) != first
    configured = CharLMTask(CharLMOptions(seed=3))
    assert parameters_vector_hash(configured.build_model()) == first


def test_build_model_leaves_global_rng_alone(stdlib_task: CharLMTask) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    stdlib_task.build_model(seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_model_holds_only_parameters(stdlib_task: CharLMTask) -> None:
    model = stdlib_task.build_model()
    assert set(model.state_dict()) == {name for name, _ in model.named_parameters()}
    assert 200_000 <= count_parameters(model) <= 1_000_000


def test_large_configuration_is_reachable() -> None:
    task = CharLMTask(CharLMOptions(d_model=512, n_layers=8, n_heads=8))
    assert count_parameters(task.build_model()) >= 25_000_000


def test_optimizer_follows_options() -> None:
    task = CharLMTask(CharLMOptions(lr=0.01, weight_decay=0.0, beta1=0.8))
    optimizer = task.build_optimizer(task.build_model().parameters())
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (0.01, 0.0, (0.8, 0.95))


def test_batches_have_the_configured_shape(small: CharLMTask) -> None:
    (batch,) = _take(small, _shard(), 0, 1)
    assert batch.inputs.shape == batch.targets.shape == (4, 16)
    assert batch.inputs.dtype == batch.targets.dtype == torch.int64
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    assert small.tokens(batch) == 64


def test_batches_are_deterministic(small: CharLMTask, fake_root: Path) -> None:
    again = CharLMTask(small.options)
    assert _same(_take(small, _shard(), 0, 10), _take(again, _shard(), 0, 10))
    assert not _same(_take(small, _shard(seed=1), 0, 10), _take(small, _shard(), 0, 10))


@pytest.mark.parametrize("start", [1, 7, 45, 130])
def test_batches_resume_at_any_step(small: CharLMTask, start: int) -> None:
    # A fake-tree epoch is a few dozen steps, so some starts land in later epochs.
    full = _take(small, _shard(rank=1), 0, start + 12)
    assert _same(_take(small, _shard(rank=1), start, 12), full[start:])


def test_stdlib_batches_resume(stdlib_task: CharLMTask) -> None:
    full = _take(stdlib_task, _shard(region_index=2), 0, 8)
    assert _same(_take(stdlib_task, _shard(region_index=2), 5, 3), full[5:])


def test_ranks_in_a_region_get_disjoint_windows(tmp_path: Path) -> None:
    # Numbered lines make every 17-byte window occur once, so rows can be located.
    for package in range(6):
        (tmp_path / f"p{package}").mkdir()
        for part in range(20):
            lines = (f"{package}{part:02d}{line:04d}\n" for line in range(30))
            (tmp_path / f"p{package}" / f"m{part}.py").write_text("".join(lines))
    task = CharLMTask(CharLMOptions(seq_len=16, batch_size=4, corpus_dir=tmp_path))
    data = task.corpus.group_data(1, 3)
    window = 17
    windows: dict[int, list[int]] = {0: [], 1: []}
    for rank in (0, 1):
        for batch in _take(task, _shard(region_index=1, rank=rank), 0, 25):
            rows = torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1)
            for row in rows.to(torch.uint8).numpy():
                offset = data.find(row.tobytes())
                assert offset >= 0
                assert data.find(row.tobytes(), offset + 1) == -1
                assert offset % window == 0
                windows[rank].append(offset // window)
    assert set(windows[0]).isdisjoint(windows[1])
    assert all(w % 2 == rank for rank in (0, 1) for w in windows[rank])
    # 100 samples per rank do not exhaust an epoch, so none repeats.
    assert len(set(windows[0])) == len(windows[0]) == 100


def test_regions_train_on_their_own_packages(small: CharLMTask) -> None:
    groups = small.corpus.assign_groups(3)
    for region in range(3):
        allowed = {ord(FAKE_UNITS[name]) for name in groups[region]} | {ord("\n")}
        seen: set[int] = set()
        for rank in (0, 1):
            for batch in _take(small, _shard(region_index=region, rank=rank), 0, 30):
                seen |= set(batch.inputs.unique().tolist()) | set(batch.targets.unique().tolist())
        assert seen <= allowed
        assert len(seen - {ord("\n")}) >= 2


def test_region_too_small_for_world_size(small: CharLMTask) -> None:
    with pytest.raises(SamplingError, match="fewer than 10000 windows"):
        next(small.batches(DataShard("r", 0, 3, 0, 10000, 0)))


def test_negative_start_step_is_refused(small: CharLMTask) -> None:
    with pytest.raises(ValueError, match="start_step"):
        small.batches(_shard(), -1)


@pytest.mark.usefixtures("one_thread")
def test_evaluate_is_deterministic_and_leaves_the_model_alone(stdlib_task: CharLMTask) -> None:
    model = stdlib_task.build_model()
    model.train()
    before = parameters_vector_hash(model)
    first = stdlib_task.evaluate(model)
    assert stdlib_task.evaluate(model) == first
    assert model.training
    assert parameters_vector_hash(model) == before
    # An untrained model is close to uniform over 256 bytes.
    assert abs(first["val_loss"] - math.log(256)) < 0.1
    assert first["val_bits_per_byte"] == pytest.approx(first["val_loss"] / math.log(2))


@pytest.mark.usefixtures("one_thread")
def test_short_training_lowers_validation_loss(stdlib_task: CharLMTask) -> None:
    torch.manual_seed(0)
    model = stdlib_task.build_model()
    optimizer = stdlib_task.build_optimizer(model.parameters())
    initial = stdlib_task.evaluate(model)["val_loss"]
    losses = []
    for batch in itertools.islice(stdlib_task.batches(_shard()), 40):
        loss = stdlib_task.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    final = stdlib_task.evaluate(model)["val_loss"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    assert final < initial - 1.0
