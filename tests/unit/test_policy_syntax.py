"""Destination patterns, endpoints, provenance and placements: the small value types."""

from __future__ import annotations

import pytest

from policies import (
    DestinationPattern,
    Endpoint,
    InvalidDestination,
    InvalidProvenance,
    JobPlacement,
    PlacementError,
    Provenance,
    StorageLocation,
)

EU_REGION = Endpoint.of_region("eu-west", "EU")
US_REGION = Endpoint.of_region("us-east", "US")
EU_STORAGE = Endpoint.of_storage("eu-ckpt", "EU", "eu-west")
LOOSE_STORAGE = Endpoint.of_storage("scratch", None)
COORDINATOR_EU = Endpoint.coordinator("EU")
COORDINATOR = Endpoint.coordinator()
ALL = [EU_REGION, US_REGION, EU_STORAGE, LOOSE_STORAGE, COORDINATOR_EU, COORDINATOR]


@pytest.mark.parametrize(
    ("pattern", "matched"),
    [
        ("*", ALL),
        ("coordinator", [COORDINATOR_EU, COORDINATOR]),
        ("region:eu-west", [EU_REGION]),  # not the storage eu-west owns
        ("storage:eu-ckpt", [EU_STORAGE]),
        ("jurisdiction:EU", [EU_REGION, EU_STORAGE, COORDINATOR_EU]),
        ("jurisdiction:US", [US_REGION]),
    ],
)
def test_pattern_matches_exactly_what_it_names(pattern: str, matched: list[Endpoint]) -> None:
    parsed = DestinationPattern.parse(pattern)
    assert str(parsed) == pattern
    assert [e for e in ALL if parsed.matches(e)] == matched


@pytest.mark.parametrize(
    "text",
    [
        "",
        "anywhere",
        "region:",
        "region:EU-West",
        "jurisdiction:eu",
        "bucket:x",
        "coordinator:x",
        5,
    ],
)
def test_bad_patterns_are_refused(text: object) -> None:
    with pytest.raises(InvalidDestination):
        DestinationPattern.parse(text)


def test_endpoints_validate_and_describe_themselves() -> None:
    assert str(EU_STORAGE) == "storage:eu-ckpt"
    assert EU_STORAGE.describe() == "storage:eu-ckpt (jurisdiction EU)"
    assert COORDINATOR.describe() == "coordinator (jurisdiction unknown)"
    with pytest.raises(InvalidDestination):
        Endpoint.of_region("Bad Name", "EU")
    with pytest.raises(InvalidDestination):
        Endpoint.of_storage("ok", "europe")


def test_provenance_parse_union_and_text() -> None:
    parsed = Provenance.parse("us-east/us-books, eu-west, us-east/us-docs")
    assert parsed.region_names == ("eu-west", "us-east")
    assert parsed.datasets_of("eu-west") is None
    assert parsed.datasets_of("us-east") == frozenset({"us-books", "us-docs"})
    assert str(parsed) == "eu-west,us-east/us-books,us-east/us-docs"
    merged = parsed.union(Provenance.of({"us-east": None, "ap-south": ["in-wiki"]}))
    assert str(merged) == "ap-south/in-wiki,eu-west,us-east"
    assert Provenance.parse("eu-west,eu-west/x").datasets_of("eu-west") is None
    assert not Provenance.of({})


@pytest.mark.parametrize("text", ["", "eu-west,", "eu-west/", "/x", "EU/x", "eu-west/Bad"])
def test_bad_provenance_is_refused(text: str) -> None:
    with pytest.raises(InvalidProvenance):
        Provenance.parse(text)


def test_placement_validates_its_input() -> None:
    placement = JobPlacement.build({"us-east": ["b"], "eu-west": {"a"}}, "EU")
    assert list(placement.regions) == ["eu-west", "us-east"]
    with pytest.raises(TypeError):
        placement.regions["x"] = frozenset()  # type: ignore[index]
    with pytest.raises(PlacementError, match="at least one region"):
        JobPlacement.build({}, "EU")
    with pytest.raises(PlacementError, match="eu-west is assigned no datasets"):
        JobPlacement.build({"eu-west": []}, "EU")
    with pytest.raises(PlacementError, match="invalid jurisdiction"):
        JobPlacement.build({"eu-west": ["a"]}, "Europe")
    with pytest.raises(PlacementError, match="repeat a name"):
        JobPlacement.build(
            {"eu-west": ["a"]}, "EU", [StorageLocation("s", "EU"), StorageLocation("s", "US")]
        )
    with pytest.raises(PlacementError, match="invalid storage location"):
        StorageLocation("S3 bucket", "EU")
