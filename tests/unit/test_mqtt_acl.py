"""The generated Mosquitto ACL: who may read and write which control topic.

The broker itself is exercised in tests/integration/test_mosquitto_acl.py; here the
rules are checked with a model of how Mosquitto's acl_file applies them (a username's
``topic`` lines, MQTT wildcard matching, anything not granted denied).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from paho.mqtt.client import topic_matches_sub

from geofed.mqtt_acl import Access, AclError, Principals, acl_rules, render_acl
from geofed_cli import main
from policies import load_policies
from tests.support.pki import make_federation

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_POLICIES = REPO / "configs" / "policies"
P = "geofed/acme"


def parse_acl(text: str) -> dict[str, list[tuple[str, str]]]:
    """username -> [(access, pattern)], read back from the file's text as Mosquitto does."""
    users: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        if keyword == "user":
            assert rest not in users, f"user {rest} appears twice"
            current = users[rest] = []
        else:
            assert keyword == "topic", line
            assert current is not None, "topic line before any user line"
            access, pattern = rest.split(" ")
            current.append((access, pattern))
    return users


def permitted(acl: dict[str, list[tuple[str, str]]], username: str, topic: str, want: str) -> bool:
    return any(
        access in (want, "readwrite") and topic_matches_sub(pattern, topic)
        for access, pattern in acl.get(username, [])
    )


@pytest.fixture
def acl() -> dict[str, list[tuple[str, str]]]:
    principals = Principals(
        federation="acme",
        regions=("us-east", "eu-west"),
        coordinators=("main",),
        observers=("grafana",),
    )
    return parse_acl(render_acl(principals))


# (username, topic, access, allowed)
CASES = [
    # A region: its own status (and Last Will), its own commands, announcements, events.
    ("region.eu-west", f"{P}/regions/eu-west/status", "write", True),
    ("region.eu-west", f"{P}/regions/eu-west/status", "read", True),
    ("region.eu-west", f"{P}/regions/eu-west/commands", "read", True),
    ("region.eu-west", f"{P}/jobs/llm-7/round", "read", True),
    ("region.eu-west", f"{P}/events", "read", True),
    ("region.eu-west", f"{P}/regions/us-east/status", "write", False),
    ("region.eu-west", f"{P}/regions/us-east/status", "read", False),
    ("region.eu-west", f"{P}/regions/us-east/commands", "read", False),
    ("region.eu-west", f"{P}/regions/eu-west/commands", "write", False),
    ("region.eu-west", f"{P}/jobs/llm-7/round", "write", False),
    ("region.eu-west", f"{P}/events", "write", False),
    ("region.eu-west", f"{P}/regions/eu-west/status/extra", "write", False),
    ("region.eu-west", "geofed/other/regions/eu-west/status", "write", False),
    # The coordinator: announcements, commands and events out; statuses in.
    ("coordinator.main", f"{P}/jobs/llm-7/round", "write", True),
    ("coordinator.main", f"{P}/jobs/llm-7/round", "read", True),
    ("coordinator.main", f"{P}/regions/eu-west/commands", "write", True),
    ("coordinator.main", f"{P}/events", "write", True),
    ("coordinator.main", f"{P}/regions/us-east/status", "read", True),
    ("coordinator.main", f"{P}/regions/us-east/status", "write", False),
    ("coordinator.main", f"{P}/regions/us-east/commands", "read", False),
    ("coordinator.main", "geofed/other/jobs/x/round", "write", False),
    # Observers read; never write.
    ("observer.grafana", f"{P}/regions/us-east/status", "read", True),
    ("observer.grafana", f"{P}/jobs/llm-7/round", "read", True),
    ("observer.grafana", "$SYS/broker/clients/connected", "read", True),
    ("observer.grafana", f"{P}/events", "write", False),
    ("observer.grafana", f"{P}/regions/us-east/status", "write", False),
    # Same name, other role: the CN keeps the role, so no confusion.
    ("observer.eu-west", f"{P}/regions/eu-west/status", "write", False),
    ("region.main", f"{P}/jobs/llm-7/round", "write", False),
    # Unlisted principals and the names a misconfigured broker might use.
    ("region.ap-south", f"{P}/regions/ap-south/status", "write", False),
    ("operator.ops", f"{P}/events", "read", False),
    ("eu-west", f"{P}/regions/eu-west/status", "write", False),
]


@pytest.mark.parametrize(("username", "topic", "access", "allowed"), CASES)
def test_acl_grants(
    acl: dict[str, list[tuple[str, str]]], username: str, topic: str, access: str, allowed: bool
) -> None:
    assert permitted(acl, username, topic, access) is allowed


def test_rules_are_sorted_by_role_then_name() -> None:
    principals = Principals("acme", regions=("us-east", "eu-west"), observers=("z", "a"))
    assert principals.regions == ("eu-west", "us-east")
    assert [rules.username for rules in acl_rules(principals)] == [
        "coordinator.main",
        "region.eu-west",
        "region.us-east",
        "observer.a",
        "observer.z",
    ]
    observer = acl_rules(principals)[-1]
    assert {grant.access for grant in observer.grants} == {Access.READ}


def test_render_is_deterministic_and_names_its_source() -> None:
    a = render_acl(Principals("acme", regions=("b", "a")), source="policies/")
    b = render_acl(Principals("acme", regions=("a", "b")), source="policies/")
    assert a == b
    assert "# Regions from: policies/" in a
    assert a.endswith("\n")
    assert "federation 'acme'" in a


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"federation": "acme", "regions": ()}, "no regions"),
        ({"federation": "acme", "regions": ("eu-west",), "coordinators": ()}, "no coordinator"),
        ({"federation": "acme", "regions": ("eu-west", "eu-west")}, "region 'eu-west' is listed"),
        ({"federation": "acme", "regions": ("eu-west",), "observers": ("g", "g")}, "listed twice"),
        ({"federation": "acme", "regions": ("EU",)}, "invalid region name 'EU'"),
        ({"federation": "acme", "regions": ("eu/+",)}, "invalid region name"),
        ({"federation": "acme", "regions": ("a b",)}, "invalid region name"),
        ({"federation": "acme", "regions": ("x",), "observers": ("#",)}, "invalid observer"),
        ({"federation": "acme", "regions": "eu-west"}, "not the string"),
        ({"federation": "Acme/x", "regions": ("eu-west",)}, "invalid federation"),
    ],
)
def test_unsound_principals_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(AclError, match=message):
        Principals(**kwargs)  # type: ignore[arg-type]


def test_a_source_cannot_inject_acl_lines() -> None:
    with pytest.raises(AclError, match="one line"):
        render_acl(Principals("acme", regions=("a",)), source="x\ntopic readwrite #")


def test_the_shipped_example_matches_the_example_policies() -> None:
    policies = load_policies([EXAMPLE_POLICIES])
    principals = Principals("demo", regions=tuple(policies), observers=("grafana",))
    expected = render_acl(principals, source="configs/policies")
    shipped = (REPO / "deploy" / "mosquitto" / "acl.example").read_text()
    assert shipped == expected, (
        "deploy/mosquitto/acl.example is stale; regenerate it from the repository root: "
        "geofed mqtt acl --policies configs/policies --federation demo --observer grafana "
        "--out deploy/mosquitto/acl.example"
    )
    assert set(parse_acl(shipped)) == {
        "coordinator.main",
        "region.ap-south",
        "region.eu-west",
        "region.us-east",
        "observer.grafana",
    }


@pytest.fixture
def policies_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "policies"
    shutil.copytree(EXAMPLE_POLICIES, directory)
    return directory


def test_cli_writes_the_acl(policies_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "acl"
    code = main(
        [
            "mqtt",
            "acl",
            "--policies",
            str(policies_dir),
            "--federation",
            "acme",
            "--coordinator",
            "main",
            "--coordinator",
            "standby",
            "--observer",
            "grafana",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    acl = parse_acl(out.read_text())
    assert set(acl) == {
        "coordinator.main",
        "coordinator.standby",
        "region.ap-south",
        "region.eu-west",
        "region.us-east",
        "observer.grafana",
    }
    assert permitted(acl, "coordinator.standby", "geofed/acme/jobs/j/round", "write")
    assert "wrote" in capsys.readouterr().err


def test_cli_prints_to_stdout_without_out(policies_dir: Path, capsys) -> None:
    assert main(["mqtt", "acl", "--policies", str(policies_dir), "--federation", "acme"]) == 0
    acl = parse_acl(capsys.readouterr().out)
    assert set(acl) == {"coordinator.main", "region.ap-south", "region.eu-west", "region.us-east"}


def test_cli_refuses_a_broken_policy_and_keeps_the_old_file(
    policies_dir: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "acl"
    out.write_text("previous\n")
    (policies_dir / "eu-west.yaml").write_text("region: eu-west\njurisdiction: [\n")
    args = ["mqtt", "acl", "--policies", str(policies_dir), "--federation", "acme"]
    assert main([*args, "--out", str(out)]) == 1
    assert "eu-west.yaml:" in capsys.readouterr().err
    assert out.read_text() == "previous\n"


def test_cli_refuses_a_bad_name_and_writes_nothing(
    policies_dir: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "acl"
    args = ["mqtt", "acl", "--policies", str(policies_dir), "--federation", "acme"]
    assert main([*args, "--observer", "Grafana", "--out", str(out)]) == 1
    assert "invalid observer name 'Grafana'" in capsys.readouterr().err
    assert not out.exists()


def test_cli_reports_an_unwritable_destination(policies_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "missing-dir" / "acl"
    args = ["mqtt", "acl", "--policies", str(policies_dir), "--federation", "acme"]
    assert main([*args, "--out", str(out)]) == 1
    assert f"cannot write {out}" in capsys.readouterr().err


def test_cli_writes_the_brokers_cafile(tmp_path: Path, capsys) -> None:
    federation = make_federation(
        tmp_path / "pki", "acme", authorities={"org-a": ["region/*"], "org-b": ["*/*"]}
    )
    out = tmp_path / "cafile.pem"
    assert main(["mqtt", "cafile", "--bundle", str(federation.bundle_file), "--out", str(out)]) == 0
    assert out.read_bytes() == federation.bundle().ca_pem()
    assert out.read_bytes().count(b"BEGIN CERTIFICATE") == 2
    err = capsys.readouterr().err
    assert "any of these 2 CAs for any name" in err
    assert "org-a, org-b" in err


def test_cli_cafile_to_stdout_and_refusals(tmp_path: Path, capsys) -> None:
    federation = make_federation(tmp_path / "pki", "acme")
    assert main(["mqtt", "cafile", "--bundle", str(federation.bundle_file)]) == 0
    captured = capsys.readouterr()
    assert captured.out.encode() == federation.bundle().ca_pem()
    assert "warning" not in captured.err
    assert main(["mqtt", "cafile", "--bundle", str(tmp_path / "missing.yaml")]) == 1
    assert "missing.yaml" in capsys.readouterr().err
