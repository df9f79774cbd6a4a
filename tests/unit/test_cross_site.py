"""Which requests another site's page could have made a browser send: the pure rule."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from coordinator.api.cross_site import cross_site_refusal

HOST = "coordinator.example:8443"


def _refusal(method: str, scheme: str = "https", host: str = HOST, **headers: str) -> str | None:
    named = CIMultiDict({name.replace("_", "-"): value for name, value in headers.items()})
    return cross_site_refusal(method, named, scheme, host)


@pytest.mark.parametrize(
    ("method", "headers", "reason"),
    [
        # What the probes sent: each refused with its reason.
        (
            "POST",
            {"Origin": "https://evil.example", "Sec_Fetch_Site": "cross-site"},
            "a cross-site request (Sec-Fetch-Site: cross-site)",
        ),
        (
            "POST",
            {"Origin": "https://evil.example"},
            "a request from another origin (Origin: https://evil.example)",
        ),
        ("POST", {"Content_Type": "application/x-www-form-urlencoded"}, "a body of type"),
        ("POST", {"Content_Type": "text/plain; charset=utf-8"}, "a body of type text/plain"),
        ("PUT", {"Content_Type": "Multipart/Form-Data; boundary=x"}, "multipart/form-data"),
        ("DELETE", {"Sec_Fetch_Site": "same-site"}, "Sec-Fetch-Site: same-site"),
        ("POST", {"Origin": "null"}, "another origin (Origin: null)"),
        # Another port or scheme is another origin.
        ("POST", {"Origin": "https://coordinator.example:9443"}, "another origin"),
        ("POST", {"Origin": "http://coordinator.example:8443"}, "another origin"),
        ("POST", {"Origin": "https://coordinator.example"}, "another origin"),
        ("POST", {"Origin": "not a url at all"}, "another origin"),
    ],
)
def test_what_a_page_may_send_is_refused(method: str, headers: dict[str, str], reason: str) -> None:
    found = _refusal(method, **headers)
    assert found is not None
    assert reason in found


@pytest.mark.parametrize(
    ("method", "headers"),
    [
        # The CLI and the agents: no browser headers, API body types.
        ("POST", {"Content_Type": "application/yaml"}),
        ("POST", {"Content_Type": "application/json; charset=utf-8"}),
        ("PUT", {"Content_Type": "application/octet-stream"}),
        ("POST", {}),
        # A page of the coordinator itself, and a user's own navigation.
        ("POST", {"Origin": "https://Coordinator.example:8443", "Sec_Fetch_Site": "same-origin"}),
        ("POST", {"Sec_Fetch_Site": "none", "Content_Type": "application/json"}),
        # Reads change nothing, whoever asks.
        ("GET", {"Origin": "https://evil.example", "Sec_Fetch_Site": "cross-site"}),
        ("HEAD", {"Content_Type": "text/plain"}),
        ("OPTIONS", {"Origin": "https://evil.example"}),
    ],
)
def test_what_the_apis_own_clients_send_passes(method: str, headers: dict[str, str]) -> None:
    assert _refusal(method, **headers) is None


def test_default_ports_are_the_same_origin() -> None:
    assert (
        _refusal("POST", host="coordinator.example", Origin="https://coordinator.example:443")
        is None
    )
    assert _refusal("POST", "http", "127.0.0.1:80", Origin="http://127.0.0.1") is None
    assert _refusal("POST", "http", "127.0.0.1:8080", Origin="http://127.0.0.1:8081") is not None
