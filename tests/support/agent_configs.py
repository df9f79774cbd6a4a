"""An agent config written for the config-loader tests: a test federation's region
credentials, the bundled policies, and the problems a load reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from regional_agent.config import AgentConfigError, load_config
from tests.support.pki import Federation, make_federation

REPO = Path(__file__).resolve().parents[2]
POLICIES = REPO / "configs" / "policies"


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    fed = make_federation(tmp_path_factory.mktemp("pki"), "acme")
    fed.region("eu-west")
    fed.region("us-east")
    return fed


def credential_dir(fed: Federation, role_name: str) -> Path:
    return fed.root / "credentials" / f"org-{role_name}"


def write(tmp_path: Path, fed: Federation, text: str | None = None, **fields: str) -> Path:
    values = {
        "federation": "acme",
        "region": "eu-west",
        "policy": str(POLICIES / "eu-west.yaml"),
        "url": "https://coordinator.acme.example:8443",
        "mqtt": "{host: mqtt.acme.example, port: 8883}",
        "cert": str(credential_dir(fed, "region-eu-west") / "cert.pem"),
        "key": str(credential_dir(fed, "region-eu-west") / "key.pem"),
        "bundle": str(fed.bundle_file),
        "extra": "",
    }
    values.update(fields)
    body = text or (
        "federation: {federation}\n"
        "region: {region}\n"
        "policy: {policy}\n"
        "coordinator_url: {url}\n"
        "mqtt: {mqtt}\n"
        "identity:\n"
        "  cert: {cert}\n"
        "  key: {key}\n"
        "  trust_bundle: {bundle}\n"
        "state_dir: state\n"
        "{extra}"
    ).format(**values)
    path = tmp_path / "agent.yaml"
    path.write_text(body)
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(AgentConfigError) as info:
        load_config(path)
    return [str(problem) for problem in info.value.problems]
