"""The evaluation section and who evaluates which global parameters."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from geofed.evaluation_config import EvaluationConfig, coordinator_evaluates, region_evaluates

PARTICIPANTS = ("us-east", "eu-west", "ap-south")


def test_defaults_to_one_region_every_round():
    config = EvaluationConfig()
    assert config.record() == {"where": "region", "every": 1}
    assert config.region is None


@pytest.mark.parametrize("where", ["region", "regions", "coordinator", "none", "region:eu-west"])
def test_accepts_each_place(where):
    assert EvaluationConfig(where=where).where == where


def test_region_names_its_region():
    assert EvaluationConfig(where="region:eu-west").region == "eu-west"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"where": "gpu"}, "not one of"),
        ({"where": "region:"}, "not one of"),
        ({"where": "region:EU West"}, "region"),
        ({"every": 0}, "greater than or equal"),
        ({"every": "2"}, "integer"),
        ({"every": 2.0}, "integer"),
        ({"whre": "none"}, "Extra inputs"),
    ],
)
def test_refuses_what_it_does_not_know(data, match):
    with pytest.raises(ValidationError, match=match):
        EvaluationConfig.model_validate(data)


def who(config: EvaluationConfig, round_: int, participants=PARTICIPANTS) -> set[str]:
    return {r for r in participants if region_evaluates(config, r, round_, participants).evaluate}


def test_by_default_the_first_participant_by_name_evaluates():
    assert who(EvaluationConfig(), 0) == {"ap-south"}
    # It follows the round: a quarantined region leaves it to the next.
    assert who(EvaluationConfig(), 3, ("us-east", "eu-west")) == {"eu-west"}


def test_regions_means_every_participant():
    assert who(EvaluationConfig(where="regions"), 2) == set(PARTICIPANTS)


def test_a_named_region_evaluates_while_it_takes_part():
    config = EvaluationConfig(where="region:us-east")
    assert who(config, 1) == {"us-east"}
    assert who(config, 1, ("eu-west", "ap-south")) == set()


@pytest.mark.parametrize("where", ["coordinator", "none"])
def test_no_region_evaluates_when_the_coordinator_or_nobody_does(where):
    decision = region_evaluates(EvaluationConfig(where=where), "ap-south", 0, PARTICIPANTS)
    assert not decision.evaluate
    assert where in decision.reason


def test_every_n_rounds():
    config = EvaluationConfig(where="regions", every=3)
    assert [r for r in range(8) if who(config, r)] == [0, 3, 6]
    decision = region_evaluates(config, "eu-west", 4, PARTICIPANTS)
    assert "multiple of 3" in decision.reason


def test_a_region_outside_the_round_never_evaluates():
    decision = region_evaluates(EvaluationConfig(where="regions"), "sa-east", 0, PARTICIPANTS)
    assert not decision.evaluate
    assert "does not take part" in decision.reason


def test_the_coordinator_evaluates_the_last_parameters_unless_nobody_evaluates():
    for where in ("region", "regions", "region:eu-west", "coordinator"):
        config = EvaluationConfig(where=where, every=4)
        assert coordinator_evaluates(config, 10, 10).evaluate, where
    assert not coordinator_evaluates(EvaluationConfig(where="none"), 10, 10).evaluate


def test_the_coordinator_evaluates_earlier_parameters_only_when_it_is_the_place():
    on_region = EvaluationConfig()
    assert [v for v in range(5) if coordinator_evaluates(on_region, v, 5).evaluate] == []
    here = EvaluationConfig(where="coordinator", every=2)
    assert [v for v in range(6) if coordinator_evaluates(here, v, 5).evaluate] == [0, 2, 4, 5]
