"""Shared value types."""

import pytest

from geofed.types import Identity, InvalidName, Role, validate_name


@pytest.mark.parametrize("name", ["eu-west", "a", "r2", "x" * 63])
def test_valid_names(name: str) -> None:
    assert validate_name("region", name) == name


@pytest.mark.parametrize("name", ["", "EU", "-a", "a-", "a/b", "a+b", "#", "x" * 64, "a b"])
def test_invalid_names(name: str) -> None:
    with pytest.raises(InvalidName, match="region"):
        validate_name("region", name)


def test_identity_round_trip() -> None:
    ident = Identity("acme", Role.REGION, "eu-west")
    assert ident.uri == "spiffe://acme/region/eu-west"
    assert ident.path == "region/eu-west"
    assert Identity.parse(ident.uri) == ident


@pytest.mark.parametrize(
    "uri",
    [
        "https://acme/region/eu-west",
        "spiffe://acme/region",
        "spiffe://acme/admin/bob",
        "spiffe://acme/region/eu-west/extra",
        "spiffe://ACME/region/eu-west",
    ],
)
def test_identity_parse_refuses(uri: str) -> None:
    with pytest.raises(InvalidName):
        Identity.parse(uri)
