"""The job spec's overlap section: modes, streaming's fragments, and what each refuses."""

from __future__ import annotations

import pytest

from coordinator.jobs.spec import DEFAULT_FRAGMENTS, JobSpecError, parse_job_spec

SPEC = """\
job: tiny
task:
  spec: tests.support.tiny_task:TinyTask
regions:
  eu-west: [eu-parliament-proceedings]
rounds: 3
inner_steps: 2
checkpoint_storage: [eu-ckpt]
"""


def _problem(text: str) -> str:
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(SPEC + text, "job.yaml")
    (problem,) = caught.value.problems
    return problem


def test_the_job_spec_takes_none_delayed_and_streaming() -> None:
    assert parse_job_spec(SPEC, "job.yaml").overlap == "none"
    for mode in ("none", "delayed", "streaming"):
        assert parse_job_spec(SPEC + f"overlap: {mode}\n", "job.yaml").overlap == mode


def test_streaming_splits_into_the_default_fragments_unless_told() -> None:
    spec = parse_job_spec(SPEC + "overlap: streaming\n", "job.yaml")
    assert spec.fragments == DEFAULT_FRAGMENTS == 4
    spec = parse_job_spec(SPEC + "overlap: streaming\nfragments: 8\n", "job.yaml")
    assert spec.fragments == 8
    assert parse_job_spec(SPEC + "overlap: delayed\n", "job.yaml").fragments is None


@pytest.mark.parametrize("value", ["1", "0", "65", "two"])
def test_out_of_range_fragments_are_refused_at_their_line(value: str) -> None:
    problem = _problem(f"overlap: streaming\nfragments: {value}\n")
    assert "job.yaml:10" in problem
    assert "fragments" in problem


def test_fragments_without_streaming_are_refused() -> None:
    problem = _problem("overlap: delayed\nfragments: 4\n")
    assert "fragments needs overlap streaming (overlap is 'delayed')" in problem


def test_streaming_does_not_start_from_the_eager_estimate() -> None:
    problem = _problem("overlap: streaming\noverlap_start: eager\n")
    assert "overlap_start 'eager' needs overlap delayed (overlap is 'streaming')" in problem


@pytest.mark.parametrize("value", ["sometimes", "1", "[delayed]"])
def test_the_job_spec_refuses_unknown_overlap_modes(value: str) -> None:
    problem = _problem(f"overlap: {value}\n")
    assert "job.yaml:9" in problem
    assert "overlap must be one of none, delayed, streaming" in problem


def test_an_explicit_null_fragments_means_the_default() -> None:
    spec = parse_job_spec(SPEC + "overlap: streaming\nfragments: ~\n", "job.yaml")
    assert spec.fragments == DEFAULT_FRAGMENTS


def test_overlap_start_eager_needs_delayed() -> None:
    assert parse_job_spec(SPEC, "job.yaml").overlap_start == "local"
    eager = parse_job_spec(SPEC + "overlap: delayed\noverlap_start: eager\n", "job.yaml")
    assert eager.overlap_start == "eager"
    assert "needs overlap delayed" in _problem("overlap_start: eager\n")
    assert "overlap_start" in _problem("overlap: delayed\noverlap_start: global\n")


def test_late_merge_is_refused_with_streaming_and_taken_otherwise() -> None:
    merging = "aggregation: {late: merge, max_staleness: 1}\n"
    problem = _problem(merging + "overlap: streaming\n")
    assert "late merge needs overlap none or delayed" in problem
    spec = parse_job_spec(SPEC + merging + "overlap: delayed\n", "job.yaml")
    assert (spec.aggregation.late, spec.aggregation.max_staleness) == ("merge", 1)
    assert parse_job_spec(SPEC, "job.yaml").aggregation.late == "drop"
