"""The coordinator's configuration: the example file, and errors that name file:line:key."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import ConfigError, load_config, parse_config
from coordinator.runtime import load_runtime
from tests.support.configs import MINIMAL_COORDINATOR as MINIMAL
from tests.support.pki import Federation, make_federation

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "configs" / "coordinator.yaml"


def _problems(text: str) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "c.yaml", base=Path("/etc/geofed"))
    return caught.value.problems


def test_the_example_configuration_loads_with_paths_beside_it() -> None:
    config = load_config(EXAMPLE)
    assert config.federation == "demo"
    assert config.tls_enabled
    assert config.tls_cert == config.identity.cert == REPO / "run/pki/coordinator/cert.pem"
    assert config.policies_dir == REPO / "configs" / "policies"
    assert [s.name for s in config.storage] == ["eu-ckpt", "us-ckpt", "ap-south-ckpt"]
    assert config.timeouts.upload_s == 120
    assert config.mqtt_client_id == "coordinator-main"
    assert config.export_destinations == {"default": ("storage:eu-ckpt", "jurisdiction:EU")}


def test_defaults_and_relative_paths() -> None:
    config = parse_config(MINIMAL, "c.yaml", base=Path("/etc/geofed"))
    assert config.listen.port == 8443
    assert config.mqtt.tls
    assert config.state_dir == Path("/etc/geofed/state")
    assert config.storage[0].path == Path("/etc/geofed/ckpt")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            MINIMAL + "timeouts: {request_s: 60, upload_s: 30}\n",
            "c.yaml:9: timeouts: inconsistent timeouts: upload_s (30) must be greater than "
            "request_s (60)",
        ),
        (MINIMAL + "listen: {hostname: x}\n", "c.yaml:9: listen.hostname: unknown key; allowed"),
        (MINIMAL.replace("jurisdiction: EU\n", ""), "c.yaml:1: jurisdiction: missing required"),
        (
            MINIMAL + "listen: {host: 0.0.0.0}\ninsecure_loopback: true\n",
            "c.yaml:10: insecure_loopback: insecure_loopback serves plain HTTP",
        ),
        (
            MINIMAL + "insecure_loopback: true\ntls: {}\n",
            "c.yaml:10: tls: tls and insecure_loopback: true exclude each other",
        ),
        (
            MINIMAL + "mqtt: {host: broker.example, tls: false}\n",
            "c.yaml:9: mqtt.tls: plain-text MQTT is allowed only to a loopback",
        ),
        (
            MINIMAL.replace("jurisdiction: EU, path", "jurisdiction: eu, path"),
            "c.yaml:8: storage[0].jurisdiction: invalid jurisdiction 'eu'",
        ),
        (
            MINIMAL + "  - {name: eu-ckpt, jurisdiction: EU, path: other}\n",
            "c.yaml:7: storage: storage names must be unique; repeated: eu-ckpt",
        ),
        (MINIMAL + "federation: other\n", "c.yaml:9: federation: duplicate key"),
        (
            MINIMAL + "export_destinations: {vision: [s3://bucket]}\n",
            "c.yaml:9: export_destinations.vision[0]: an export destination is storage:NAME "
            "or jurisdiction:CODE (got 's3://bucket')",
        ),
        (
            MINIMAL + "export_destinations: {vision: [jurisdiction:eu]}\n",
            "c.yaml:9: export_destinations.vision[0]: invalid jurisdiction 'eu'",
        ),
        (
            MINIMAL + "export_destinations: {Bad Team: [jurisdiction:EU]}\n",
            "c.yaml:9: export_destinations.Bad Team: invalid key 'Bad Team': invalid team",
        ),
    ],
)
def test_errors_name_file_line_and_key(change: str, expected: str) -> None:
    problems = _problems(change)
    assert any(problem.startswith(expected) for problem in problems), problems


def test_an_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.yaml: \(file\): cannot read"):
        load_config(tmp_path / "missing.yaml")


def _write(tmp_path: Path, federation: str = "acme", **replace: str) -> tuple[Path, Federation]:
    fed = make_federation(tmp_path / "fed", federation)
    coordinator = fed.coordinator()
    text = f"""\
federation: acme
jurisdiction: EU
trust_bundle: {fed.bundle_file}
identity: {{cert: {coordinator.cert_file}, key: {coordinator.key_file}}}
state_dir: state
policies_dir: {REPO / "configs" / "policies"}
storage:
  - {{name: eu-ckpt, jurisdiction: EU, path: ckpt}}
"""
    for old, new in replace.items():
        text = text.replace(old, new)
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path, fed


def test_runtime_loads_what_the_configuration_names(tmp_path: Path) -> None:
    runtime = load_runtime(load_config(_write(tmp_path)[0]))
    assert runtime.signer.identity.uri == "spiffe://acme/coordinator/main"
    assert runtime.locations["eu-ckpt"].region == "eu-west"  # declared in eu-west's policy
    assert set(runtime.policies) == {"ap-south", "eu-west", "us-east"}
    assert set(runtime.certificate_expiry()) == {"identity", "tls"}


def test_runtime_refuses_a_bundle_of_another_federation(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_runtime(load_config(_write(tmp_path, federation="other")[0]))
    assert "is for federation 'other', the configuration says 'acme'" in str(caught.value)


def test_runtime_refuses_storage_that_contradicts_the_policies(tmp_path: Path) -> None:
    path, _ = _write(tmp_path, **{"jurisdiction: EU, path": "jurisdiction: US, path"})
    with pytest.raises(ConfigError) as caught:
        load_runtime(load_config(path))
    assert "storage eu-ckpt: jurisdiction US differs from EU declared at" in str(caught.value)


@pytest.mark.parametrize(
    ("trusted", "expected"),
    [(True, "expected spiffe://acme/coordinator/main"), (False, "refused by the trust bundle")],
)
def test_runtime_refuses_an_identity_that_is_not_this_coordinator(
    tmp_path: Path, trusted: bool, expected: str
) -> None:
    path, fed = _write(tmp_path / "a")
    other = fed if trusted else make_federation(tmp_path / "b", "acme")
    region = other.region("eu-west")
    lines = [
        f"identity: {{cert: {region.cert_file}, key: {region.key_file}}}"
        if line.startswith("identity:")
        else line
        for line in path.read_text().splitlines()
    ]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as caught:
        load_runtime(load_config(path))
    assert expected in " ".join(caught.value.problems)
