"""LlamaTask: preset sizes, the tiny model's forward and backward, its rebuilt RoPE buffer."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from coordinator.jobs.initial_build import initial_parameters
from coordinator.publication.evaluation_process import evaluate_params
from geofed.examples.charlm.data import TokenBatch
from geofed.examples.llama import PRESETS, Llama, LlamaConfig, LlamaOptions, LlamaTask
from geofed.examples.llama.model import apply_rotary, rotary_table
from geofed.params import (
    count_parameters,
    federated_state,
    load_federated_state,
    parameters_vector_hash,
    state_to_fp32,
)
from geofed.task import DataShard, TaskOptionsError, load_task
from tests.support.fake_stdlib import make_fake_stdlib

SPEC = "geofed.examples.llama:LlamaTask"


@pytest.fixture(scope="module")
def fake_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fake_stdlib(tmp_path_factory.mktemp("stdlib"))


@pytest.fixture(scope="module")
def tiny(fake_root: Path) -> LlamaTask:
    return LlamaTask(LlamaOptions(seq_len=32, batch_size=4, val_batches=2, corpus_dir=fake_root))


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _shard() -> DataShard:
    return DataShard("region-0", 0, 2, 0, 1, 0)


@pytest.mark.parametrize(
    ("preset", "expected"),
    [("tiny", 1e6), ("125m", 125e6), ("350m", 350e6), ("1b", 1e9)],
)
def test_presets_are_about_their_names_size(preset: str, expected: float) -> None:
    # Counted from the architecture: the big presets are never built here.
    task = load_task(SPEC, {"preset": preset})
    assert isinstance(task, LlamaTask)
    count = task.config.parameter_count()
    assert 0.95 * expected <= count <= 1.1 * expected


@pytest.mark.parametrize("tie", [False, True])
def test_the_analytic_count_is_the_built_count(tie: bool) -> None:
    task = LlamaTask(LlamaOptions(tie_embeddings=tie, seq_len=16))
    model = task.build_model()
    assert count_parameters(model) == task.config.parameter_count()
    names = set(federated_state(model))
    assert ("output.weight" in names) is not tie
    assert "tok_embeddings.weight" in names


def test_options_override_the_preset_and_refuse_what_cannot_be_built() -> None:
    task = load_task(SPEC, {"preset": "125m", "n_layers": 2, "dim": 64, "n_heads": 4})
    assert isinstance(task, LlamaTask)
    assert (task.config.dim, task.config.n_layers, task.config.n_heads) == (64, 2, 4)
    assert task.config.ffn_dim == PRESETS["125m"].ffn_dim
    with pytest.raises(TaskOptionsError, match="not divisible by n_kv_heads"):
        load_task(SPEC, {"n_heads": 4, "n_kv_heads": 3})
    with pytest.raises(TaskOptionsError, match="preset"):
        load_task(SPEC, {"preset": "7b"})
    with pytest.raises(TaskOptionsError, match="layers"):
        load_task(SPEC, {"layers": 3})


def test_tiny_forward_and_backward(tiny: LlamaTask) -> None:
    model = tiny.build_model()
    batch = next(tiny.batches(_shard()))
    assert model(batch.inputs).shape == (4, 32, 256)
    loss = tiny.loss(model, batch)
    assert abs(loss.item() - math.log(256)) < 0.2
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name


def test_the_model_is_causal(tiny: LlamaTask) -> None:
    model = tiny.build_model().eval()
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(model(tokens)[0, :10], model(changed)[0, :10], atol=1e-6)
        assert not torch.allclose(model(tokens)[0, 10:], model(changed)[0, 10:])


def test_rotary_rotates_pairs_without_changing_their_length() -> None:
    table = rotary_table(8, 5, 10000.0)
    assert table.dtype == torch.complex64
    x = torch.randn(2, 5, 3, 8, generator=torch.Generator().manual_seed(1))
    rotated = apply_rotary(x, table)
    assert rotated.shape == x.shape
    assert torch.allclose(rotated[:, 0], x[:, 0])  # position 0 is not rotated
    norms = x.reshape(2, 5, 3, 4, 2).norm(dim=-1)
    assert torch.allclose(rotated.reshape(2, 5, 3, 4, 2).norm(dim=-1), norms, atol=1e-5)


def test_the_complex_rope_table_is_state_but_not_federated(tiny: LlamaTask) -> None:
    model = tiny.build_model()
    assert isinstance(model, Llama)
    assert model.state_dict()["freqs_cis"].dtype == torch.complex64
    assert "freqs_cis" not in federated_state(model)
    theta0 = initial_parameters(tiny, seed=3)
    assert "freqs_cis" not in theta0
    assert {t.dtype for t in theta0.values()} == {torch.float32}
    assert parameters_vector_hash(theta0) == parameters_vector_hash(tiny.build_model(seed=3))
    assert parameters_vector_hash(initial_parameters(tiny, seed=3)) == parameters_vector_hash(
        theta0
    )
    assert parameters_vector_hash(initial_parameters(tiny, seed=4)) != parameters_vector_hash(
        theta0
    )
    # θ goes back into a freshly built model; its table is the one build_model made.
    fresh = tiny.build_model(seed=9)
    load_federated_state(fresh, theta0)
    assert parameters_vector_hash(fresh) == parameters_vector_hash(theta0)
    assert torch.equal(fresh.state_dict()["freqs_cis"], model.state_dict()["freqs_cis"])


def test_the_coordinator_evaluates_a_federated_state(tiny: LlamaTask) -> None:
    theta0 = initial_parameters(tiny, seed=3)
    metrics = evaluate_params(tiny, 3, theta0)
    assert metrics == tiny.evaluate(tiny.build_model(seed=3))
    assert abs(metrics["val_loss"] - math.log(256)) < 0.2


def test_hooks_name_the_blocks_and_count_flops(tiny: LlamaTask) -> None:
    model = tiny.build_model()
    assert isinstance(model, Llama)
    blocks = list(model.layers)
    # The embedding and the untied head are units of their own, each block another.
    assert list(tiny.fsdp_units(model)) == [model.tok_embeddings, *blocks, model.output]
    assert list(tiny.checkpoint_units(model)) == blocks
    tied = LlamaTask(LlamaOptions(tie_embeddings=True))
    tied_model = tied.build_model()
    assert isinstance(tied_model, Llama)
    assert list(tied.fsdp_units(tied_model)) == list(tied_model.layers)
    config: LlamaConfig = tiny.config
    dense = count_parameters(model) - 256 * config.dim
    expected = 6 * dense + 12 * config.n_layers * config.dim * 32
    assert tiny.flops_per_token(model) == pytest.approx(expected)
    with pytest.raises(TypeError, match="Llama"):
        tiny.fsdp_units(torch.nn.Linear(2, 2))


@pytest.mark.usefixtures("one_thread")
def test_a_few_steps_lower_the_loss(tiny: LlamaTask) -> None:
    model = tiny.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches: list[TokenBatch] = list(itertools.islice(tiny.batches(_shard()), 4))
    first = sum(tiny.loss(model, b).item() for b in batches) / len(batches)
    for _ in range(5):
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            tiny.loss(model, batch).backward()
            optimizer.step()
    with torch.no_grad():
        last = sum(tiny.loss(model, b).item() for b in batches) / len(batches)
    assert last < first - 0.5
    assert set(state_to_fp32(model)) == set(federated_state(model))
