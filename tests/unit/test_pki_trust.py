"""Trust bundle files: loading, errors with file:line:key, grants, revocation."""

from __future__ import annotations

from pathlib import Path

import pytest

from geofed.pki import (
    Grant,
    InvalidGrant,
    TrustBundleError,
    add_revoked_serials,
    create_ca,
    format_serial,
    load_trust_bundle,
    parse_serial,
    save_ca,
)
from geofed.types import Identity, Role
from tests.support.pki import make_federation


@pytest.fixture(scope="module")
def ca_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bundle")
    save_ca(create_ca("acme", "org-a"), root / "org-a")
    save_ca(create_ca("acme", "org-b"), root / "org-b")
    return root


def _write(root: Path, text: str, name: str = "bundle.yaml") -> Path:
    path = root / name
    path.write_text(text)
    return path


GOOD = """\
federation: acme
authorities:
  - name: org-a
    certificate: org-a/ca.pem
    grants: ["coordinator/*", "operator/*", "region/eu-*"]
  - name: org-b
    certificate: org-b/ca.pem
    grants: ["region/us-*"]
revoked_serials: ["4F:1C", "abc"]
"""


def test_loads_authorities_grants_and_serials(ca_root):
    bundle = load_trust_bundle(_write(ca_root, GOOD))
    assert bundle.federation == "acme"
    assert [a.name for a in bundle.authorities] == ["org-a", "org-b"]
    org_a, org_b = bundle.authorities
    assert org_a.allows(Identity("acme", Role.REGION, "eu-west"))
    assert not org_a.allows(Identity("acme", Role.REGION, "us-east"))
    assert org_b.allows(Identity("acme", Role.REGION, "us-east"))
    assert not org_b.allows(Identity("acme", Role.OPERATOR, "alice"))
    assert bundle.revoked_serials == {0x4F1C, 0xABC}
    assert bundle.ca_pem().count(b"BEGIN CERTIFICATE") == 2


def test_default_bundle_of_ca_init_trusts_only_that_ca(ca_root):
    bundle = load_trust_bundle(ca_root / "org-a" / "trust.yaml")
    assert [a.name for a in bundle.authorities] == ["org-a"]
    assert bundle.authorities[0].allows(Identity("acme", Role.OBSERVER, "anyone"))
    assert bundle.revoked_serials == frozenset()


@pytest.mark.parametrize(
    ("text", "line", "key", "message"),
    [
        (GOOD.replace("federation: acme", "federation: Acme"), 1, "federation", "invalid"),
        (
            GOOD.replace('    grants: ["region/us-*"]', '    grants: ["regoin/us-*"]'),
            8,
            "authorities[1].grants[0]",
            "matches no role",
        ),
        (
            GOOD.replace("  - name: org-b", "  - name: org-b\n    colour: blue"),
            7,
            "authorities[1].colour",
            "Extra inputs",
        ),
        (
            GOOD.replace('revoked_serials: ["4F:1C", "abc"]', "revoked_serials:\n  - 1234"),
            10,
            "revoked_serials[0]",
            "quoted hex string",
        ),
        (GOOD.replace('"abc"', '"xyz"'), 9, "revoked_serials[1]", "not a hex number"),
        (
            GOOD.replace("org-b/ca.pem", "org-c/ca.pem"),
            7,
            "authorities[1].certificate",
            "org-c/ca.pem",
        ),
        (
            GOOD.replace("org-b/ca.pem", "org-b/ca.yaml"),
            7,
            "authorities[1].certificate",
            "org-b/ca.yaml",
        ),
        (GOOD.replace("name: org-b", "name: org-a"), 2, "authorities", "repeated: org-a"),
        (
            GOOD.replace('    grants: ["region/us-*"]', "    grants: []"),
            8,
            "authorities[1].grants",
            "at least 1",
        ),
        (GOOD.replace("authorities:", "federation: acme\nauthorities:"), 2, None, "duplicate key"),
        (GOOD.replace('grants: ["region/us-*"]', 'grants: ["region/us-*"'), 9, None, ""),
        ("- just\n- a list\n", 1, None, "expected a mapping"),
        (GOOD.replace("federation: acme\n", ""), 1, "federation", "Field required"),
    ],
)
def test_errors_name_file_line_and_key(ca_root, text, line, key, message):
    path = _write(ca_root, text, "broken.yaml")
    with pytest.raises(TrustBundleError) as caught:
        load_trust_bundle(path)
    err = caught.value
    assert err.path == path
    assert err.line == line
    assert err.key == key
    assert message in str(err)
    assert str(err).startswith(f"{path}:{line}: ")


def test_a_leaf_certificate_cannot_be_an_authority(ca_root, tmp_path):
    fed = make_federation(tmp_path / "fed", "acme")
    leaf = fed.region("eu-west")
    text = GOOD.replace("org-b/ca.pem", str(leaf.cert_file))
    with pytest.raises(TrustBundleError, match="not a CA certificate"):
        load_trust_bundle(_write(ca_root, text, "leaf.yaml"))


def test_missing_file_is_a_trust_bundle_error(tmp_path):
    with pytest.raises(TrustBundleError, match="cannot read trust bundle"):
        load_trust_bundle(tmp_path / "absent.yaml")


def test_yaml_alias_bombs_load_in_linear_time(ca_root):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 40)]
    path = _write(ca_root, "\n".join(lines) + "\n" + GOOD, "bomb.yaml")
    with pytest.raises(TrustBundleError, match="Extra inputs"):
        load_trust_bundle(path)


def test_revocations_are_appended_once_and_reloaded(ca_root):
    path = _write(ca_root, GOOD, "revoke.yaml")
    assert add_revoked_serials(path, [0x10, 0x4F1C, 0x10]) == [0x10]
    assert add_revoked_serials(path, [0x10]) == []
    assert load_trust_bundle(path).revoked_serials == {0x4F1C, 0xABC, 0x10}


def test_revoking_keeps_a_broken_bundle_untouched(ca_root):
    text = GOOD.replace("federation: acme", "federation: ACME")
    path = _write(ca_root, text, "broken-revoke.yaml")
    with pytest.raises(TrustBundleError):
        add_revoked_serials(path, [1])
    assert path.read_text() == text


@pytest.mark.parametrize(
    ("grant", "identity", "allowed"),
    [
        ("region/eu-*", Identity("acme", Role.REGION, "eu-west"), True),
        ("region/eu-*", Identity("acme", Role.REGION, "us-east"), False),
        ("region/eu-*", Identity("acme", Role.OBSERVER, "eu-west"), False),
        ("*/*", Identity("acme", Role.COORDINATOR, "main"), True),
        ("o*/a?ice", Identity("acme", Role.OPERATOR, "alice"), True),
        ("o*/a?ice", Identity("acme", Role.OBSERVER, "alice"), True),
        ("region/[ab]*", Identity("acme", Role.REGION, "c1"), False),
    ],
)
def test_grant_matching(grant, identity, allowed):
    assert Grant.parse(grant).allows(identity) is allowed


@pytest.mark.parametrize(
    "text", ["region", "region/eu/west", "Region/x", "region/", "admin/*", "*/a b"]
)
def test_invalid_grants(text):
    with pytest.raises(InvalidGrant):
        Grant.parse(text)


def test_serial_forms():
    assert parse_serial("4F:1c") == parse_serial("0x4f1c") == 0x4F1C
    assert format_serial(0x4F1C) == "4f1c"
    with pytest.raises(ValueError, match="hex"):
        parse_serial("1" * 41)
