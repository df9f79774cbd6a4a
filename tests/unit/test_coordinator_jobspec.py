"""Job specs: the example, defaults, JSON bodies, and errors that name line and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from coordinator.aggregation.config import AggregationConfig
from coordinator.jobs.spec import JobSpecError, parse_job_spec, parse_stored_spec
from coordinator.rounds.deadline import DeadlineError
from geofed.evaluation_config import EvaluationConfig
from geofed.timeouts import Timeouts
from geofed.training_config import LrSchedule, TrainingConfig

REPO = Path(__file__).resolve().parents[2]

SPEC = """\
job: tiny
task:
  spec: tests.support.tiny_task:TinyTask
  options: {hidden: 8}
regions:
  eu-west: [eu-parliament-proceedings]
  us-east: [us-public-domain-books]
rounds: 3
inner_steps: 2
checkpoint_storage: [eu-ckpt]
"""


def _problems(text: str) -> tuple[str, ...]:
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(text, "job.yaml")
    return caught.value.problems


def test_the_example_job_parses() -> None:
    path = REPO / "configs" / "job-charlm.yaml"
    spec = parse_job_spec(path.read_text(), str(path))
    assert spec.job == "charlm-demo"
    assert spec.quorum == 2
    assert spec.region_names == ("eu-west", "us-east")
    outer = spec.outer_optimizer
    assert (outer.lr, outer.momentum, outer.momentum_warmup_rounds) == (0.3, 0.8, 4)
    assert spec.codec.rounding_to_nearest().scheme == "int8"
    assert spec.checkpoint_storage == ("eu-ckpt", "us-ckpt")
    assert spec.training == TrainingConfig()


def test_the_example_job_fits_a_coordinator_with_default_timeouts() -> None:
    """Its minimum deadline outlasts the default upload timeout (and the shipped one)."""
    path = REPO / "configs" / "job-charlm.yaml"
    spec = parse_job_spec(path.read_text(), str(path))
    spec.deadline.check_against(Timeouts())
    shipped = yaml.safe_load((REPO / "configs" / "coordinator.yaml").read_text())["timeouts"]
    spec.deadline.check_against(Timeouts(**shipped))
    with pytest.raises(DeadlineError, match=r"the coordinator's timeouts\.upload_s \(400\)"):
        spec.deadline.check_against(Timeouts(upload_s=400, download_s=400, round_deadline_s=1800))


def test_defaults() -> None:
    spec = parse_job_spec(SPEC, "job.yaml")
    assert spec.quorum == 2  # every region unless min_regions says otherwise
    assert (spec.codec.scheme, spec.codec.block_size, spec.codec.zstd_level) == ("int8", 128, 1)
    assert spec.outer_optimizer.kind == "nesterov"
    assert spec.snapshot_every == 10
    assert spec.max_round_attempts == 3
    assert spec.task.options == {"hidden": 8}
    assert spec.training == TrainingConfig()
    assert (spec.training.parallelism, spec.training.precision) == ("ddp", "fp32")
    assert spec.training.grad_clip_norm is None
    assert spec.training.grad_accumulation == 1
    assert spec.training.activation_checkpointing is False
    assert spec.training.lr_schedule == LrSchedule(kind="constant")
    assert spec.total_steps == 6
    assert spec.evaluation == EvaluationConfig(where="region", every=1)


def test_an_aggregation_section_is_read_and_kept_with_the_job() -> None:
    text = SPEC + "aggregation: {rule: median, norm_check: clip, max_tokens_per_round: 5000}\n"
    spec = parse_job_spec(text, "job.yaml")
    assert spec.aggregation == AggregationConfig(
        rule="median", norm_check="clip", max_tokens_per_round=5000
    )
    stored = json.loads(json.dumps(spec.to_json()))
    assert parse_stored_spec(stored) == spec
    del stored["aggregation"]  # stored before the section existed
    assert parse_stored_spec(stored).aggregation == AggregationConfig()
    assert parse_stored_spec(stored).aggregation.token_bound(spec.inner_steps) == 2 * (1 << 24)


def test_norm_check_off_survives_a_yaml_1_1_round_trip() -> None:
    # PyYAML's safe_load reads a bare `off` as false; a spec re-serialised by such a tool
    # still means off, while other booleans stay refused.
    text = SPEC + "aggregation:\n  norm_check: off\n"
    assert parse_job_spec(text, "job.yaml").aggregation.norm_check == "off"
    spec = json.loads(json.dumps(parse_job_spec(text, "job.yaml").to_json()))
    spec["aggregation"]["norm_check"] = False
    assert parse_job_spec(json.dumps(spec), "job.json").aggregation.norm_check == "off"
    spec["aggregation"]["norm_check"] = True
    with pytest.raises(JobSpecError, match="norm_check"):
        parse_job_spec(json.dumps(spec), "job.json")


def test_an_evaluation_section_is_read_and_kept_with_the_job() -> None:
    spec = parse_job_spec(SPEC + "evaluation: {where: 'region:us-east', every: 2}\n", "job.yaml")
    assert spec.evaluation == EvaluationConfig(where="region:us-east", every=2)
    stored = json.loads(json.dumps(spec.to_json()))
    assert stored["evaluation"] == {"where": "region:us-east", "every": 2}
    assert parse_stored_spec(stored) == spec
    del stored["evaluation"]  # stored before the section existed
    assert parse_stored_spec(stored).evaluation == EvaluationConfig()


TRAINING = """\
training:
  parallelism: fsdp
  precision: bf16
  grad_clip_norm: 1
  grad_accumulation: 4
  activation_checkpointing: true
  lr_schedule: {kind: warmup_cosine, warmup_steps: 2, min_lr_ratio: 0.1}
"""


def test_a_training_section_is_read_and_kept_with_the_job() -> None:
    spec = parse_job_spec(SPEC + TRAINING, "job.yaml")
    assert spec.training == TrainingConfig(
        parallelism="fsdp",
        precision="bf16",
        grad_clip_norm=1,
        grad_accumulation=4,
        activation_checkpointing=True,
        lr_schedule=LrSchedule(kind="warmup_cosine", warmup_steps=2, min_lr_ratio=0.1),
    )
    stored = json.loads(json.dumps(spec.to_json()))
    assert stored["training"]["lr_schedule"] == {
        "kind": "warmup_cosine",
        "warmup_steps": 2,
        "min_lr_ratio": 0.1,
    }
    assert parse_stored_spec(stored) == spec


def test_a_job_stored_without_a_training_section_trains_with_the_defaults() -> None:
    stored = parse_job_spec(SPEC, "job.yaml").to_json()
    del stored["training"]
    assert parse_stored_spec(stored).training == TrainingConfig()


def test_json_bodies_are_accepted_even_with_tabs() -> None:
    document = parse_job_spec(SPEC, "job.yaml").to_json()
    text = json.dumps(document, indent="\t")
    assert parse_job_spec(text, "request") == parse_job_spec(SPEC, "job.yaml")
    assert parse_stored_spec(json.loads(text)) == parse_job_spec(SPEC, "job.yaml")
    with pytest.raises(JobSpecError, match=r"request:3: \(syntax\): Expecting value"):
        parse_job_spec('{\n\t"job": "tiny",\n\t"rounds": }', "request")


def test_average_means_plain_averaging() -> None:
    spec = parse_job_spec(SPEC + "outer_optimizer: {kind: average}\n", "job.yaml")
    assert (spec.outer_optimizer.lr, spec.outer_optimizer.momentum) == (1.0, 0.0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (SPEC + "min_regions: 3\n", "job.yaml:1: (document): min_regions (3) exceeds the 2"),
        (SPEC.replace("rounds: 3", "rounds: 0"), "job.yaml:8: rounds: Input should be greater"),
        # Sizes no job has are refused at submission, not stored to fail later.
        (
            SPEC.replace("rounds: 3", "rounds: 100000000000000000000000"),
            "job.yaml:8: rounds: Input should be less than or equal to 10000000",
        ),
        (
            SPEC.replace("inner_steps: 2", "inner_steps: 4611686018427387904"),
            "job.yaml:9: inner_steps: Input should be less than or equal to 10000000",
        ),
        (
            SPEC + "max_round_attempts: 10000000000000000000000\n",
            "job.yaml:11: max_round_attempts: Input should be less than or equal to 1000",
        ),
        (
            SPEC + "snapshot_every: 100000000000\n",
            "job.yaml:11: snapshot_every: snapshot_every must be a whole number in 1..10000000",
        ),
        (
            SPEC + "deadline: {max_s: 1e300}\n",
            "job.yaml:11: deadline.max_s: Input should be less than or equal to 2592000",
        ),
        (
            SPEC.replace("[us-public-domain-books]", "[]"),
            "job.yaml:5: regions: region us-east is assigned no datasets",
        ),
        (
            SPEC.replace("tiny_task:TinyTask", "tiny_task"),
            "job.yaml:3: task.spec: malformed task spec",
        ),
        (SPEC + "codec: {block_size: 33}\n", "job.yaml:11: codec.block_size: block_size 33 must"),
        (SPEC + "codec: {zstd_level: 0}\n", "job.yaml:11: codec.zstd_level: Input should be"),
        (
            SPEC + "outer_optimizer: {kind: average, lr: 0.5}\n",
            "job.yaml:11: outer_optimizer: kind 'average' means lr 1.0",
        ),
        (
            SPEC + "deadline: {initial_s: 10, min_s: 60}\n",
            "job.yaml:11: deadline: need min_s <= initial_s <= max_s",
        ),
        (
            SPEC.replace("[eu-ckpt]", "[eu-ckpt, eu-ckpt]"),
            "job.yaml:10: checkpoint_storage: checkpoint_storage repeats a name",
        ),
        (SPEC + "round: 3\n", "job.yaml:11: round: unknown key; allowed keys: job, task"),
        (
            SPEC + "training: {parallelism: ddp, precison: bf16}\n",
            "job.yaml:11: training.precison: unknown key; allowed keys: parallelism, "
            "hsdp_shard_ranks, precision,",
        ),
        (
            SPEC + TRAINING.replace("warmup_steps: 2,", "warmup_steps: 2, cycles: 3,"),
            "job.yaml:17: training.lr_schedule.cycles: unknown key; allowed keys: kind, warmup",
        ),
        (
            SPEC + "training: {parallelism: zero3}\n",
            "job.yaml:11: training.parallelism: Input should be 'ddp', 'fsdp' or 'hsdp'",
        ),
        (
            SPEC + "training: {precision: fp16}\n",
            "job.yaml:11: training.precision: Input should be 'fp32' or 'bf16'",
        ),
        (
            SPEC + "training: {grad_clip_norm: 0}\n",
            "job.yaml:11: training.grad_clip_norm: Input should be greater than 0",
        ),
        (
            SPEC + "training: {grad_accumulation: 0}\n",
            "job.yaml:11: training.grad_accumulation: Input should be greater than or equal to 1",
        ),
        (
            SPEC + "training: {grad_accumulation: '2'}\n",
            "job.yaml:11: training.grad_accumulation: Input should be a valid integer",
        ),
        (
            SPEC + "training: {activation_checkpointing: 'yes'}\n",
            "job.yaml:11: training.activation_checkpointing: Input should be a valid boolean",
        ),
        (
            SPEC + "training: {lr_schedule: {kind: linear}}\n",
            "job.yaml:11: training.lr_schedule.kind: Input should be 'constant' or 'warmup_",
        ),
        (
            SPEC + TRAINING.replace("min_lr_ratio: 0.1", "min_lr_ratio: 1.5"),
            "job.yaml:17: training.lr_schedule.min_lr_ratio: Input should be less",
        ),
        (
            SPEC + "training: {lr_schedule: {kind: constant, warmup_steps: 5}}\n",
            "job.yaml:11: training.lr_schedule: a constant schedule takes no warmup_steps",
        ),
        (
            SPEC + TRAINING.replace("warmup_steps: 2", "warmup_steps: 7"),
            "job.yaml:1: (document): training.lr_schedule.warmup_steps (7) exceeds the job's 6",
        ),
        (SPEC.replace("job: tiny", "job: Tiny_Job"), "job.yaml:1: job: invalid job 'Tiny_Job'"),
        (
            SPEC + "evaluation: {where: gpu}\n",
            "job.yaml:11: evaluation.where: 'gpu' is not one of region, region:NAME",
        ),
        (
            SPEC + "evaluation:\n  where: regions\n  evry: 2\n",
            "job.yaml:13: evaluation.evry: unknown key; allowed keys: where, every",
        ),
        (
            SPEC + "evaluation: {every: 0}\n",
            "job.yaml:11: evaluation.every: Input should be greater than or equal to 1",
        ),
        (
            SPEC + "aggregation: {rule: mode}\n",
            "job.yaml:11: aggregation.rule: Input should be 'mean', 'trimmed_mean' or 'median'",
        ),
        (
            SPEC + "aggregation:\n  norm_check: refuse\n  max_norm_ratio: 1\n",
            "job.yaml:13: aggregation.max_norm_ratio: Input should be greater than 1",
        ),
        (
            SPEC + "aggregation: {max_tokens_per_round: 0}\n",
            "job.yaml:11: aggregation.max_tokens_per_round: Input should be greater than or equal",
        ),
        (
            SPEC + "evaluation: {where: 'region:ap-south'}\n",
            "job.yaml:1: (document): evaluation.where names region ap-south, which is not one",
        ),
    ],
)
def test_errors_name_line_and_key(text: str, expected: str) -> None:
    problems = _problems(text)
    assert any(problem.startswith(expected) for problem in problems), problems
