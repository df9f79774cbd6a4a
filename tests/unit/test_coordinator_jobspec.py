"""Job specs: the example, defaults, JSON bodies, and errors that name line and key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.jobspec import JobSpecError, parse_job_spec, parse_stored_spec

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
    assert (spec.outer_optimizer.lr, spec.outer_optimizer.momentum) == (0.7, 0.9)
    assert spec.codec.rounding_to_nearest().scheme == "int8"
    assert spec.checkpoint_storage == ("eu-ckpt", "us-ckpt")


def test_defaults() -> None:
    spec = parse_job_spec(SPEC, "job.yaml")
    assert spec.quorum == 2  # every region unless min_regions says otherwise
    assert (spec.codec.scheme, spec.codec.block_size, spec.codec.zstd_level) == ("int8", 128, 1)
    assert spec.outer_optimizer.kind == "nesterov"
    assert spec.snapshot_every == 10
    assert spec.max_round_attempts == 3
    assert spec.task.options == {"hidden": 8}


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
        (SPEC.replace("job: tiny", "job: Tiny_Job"), "job.yaml:1: job: invalid job 'Tiny_Job'"),
    ],
)
def test_errors_name_line_and_key(text: str, expected: str) -> None:
    problems = _problems(text)
    assert any(problem.startswith(expected) for problem in problems), problems
