"""The agent's config loader: typed, resolved paths, errors naming file, line and key."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from geofed.data import DatasetLocation
from geofed_cli import main as geofed_main
from regional_agent.config import (
    dataset_locations,
    load_config,
    training_datasets,
)
from regional_agent.config import load_region_policies as region_policies
from regional_agent.credentials import CredentialsError, load_credentials
from tests.support.agent_configs import POLICIES, credential_dir, federation, problems, write
from tests.support.pki import Federation, make_federation

REPO = Path(__file__).resolve().parents[2]
__all__ = ["federation"]  # the fixture


def test_a_valid_config_loads_with_defaults_and_resolved_paths(
    tmp_path: Path, federation: Federation
) -> None:
    config = load_config(write(tmp_path, federation))
    assert config.state_dir == tmp_path / "state"
    assert config.workers.count == "auto"
    assert config.workers.backend == "auto"
    assert config.mqtt.tls is True
    assert config.timeouts.request_s == 30
    assert config.identity_uri.uri == "spiffe://acme/region/eu-west"
    assert config.workers_dir == tmp_path / "state" / "workers"


@pytest.fixture(autouse=True)
def _policy_next_to_config(tmp_path: Path) -> None:
    # Relative policy paths resolve against the config file's directory.
    (tmp_path.parent / "policy.yaml").write_text((POLICIES / "eu-west.yaml").read_text())


def test_relative_paths_resolve_against_the_config_file(
    tmp_path: Path, federation: Federation
) -> None:
    config = load_config(write(tmp_path, federation, policy="../policy.yaml"))
    assert config.policy == tmp_path / ".." / "policy.yaml"
    assert config.policy.is_file()


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"mqtt": "{host: h, port: '8883'}"}, "agent.yaml:5: mqtt.port: Input should be a valid"),
        ({"mqtt": "{host: h, prot: 1}"}, "agent.yaml:5: mqtt.prot: unknown key; allowed keys"),
        ({"region": "EU_West"}, "agent.yaml:2: region: invalid region 'EU_West'"),
        ({"url": "ftp://x"}, "agent.yaml:4: coordinator_url: 'ftp://x' is not an http"),
        (
            {"url": "http://coordinator.acme.example:8443"},
            "agent.yaml:1: (document): coordinator_url 'http://coordinator.acme.example:8443' "
            "must be https://",
        ),
        (
            {"url": "http://10.0.0.5:8443", "extra": "insecure_loopback: true\n"},
            "is not a loopback address; plain HTTP leaves no machine",
        ),
        (
            {"mqtt": "{host: mqtt.acme.example, port: 1883, tls: false}"},
            "mqtt.tls: false, but mqtt.host 'mqtt.acme.example' is not a loopback address",
        ),
        (
            {"extra": "timeouts: {request_s: 3, upload_s: 2}\n"},
            "agent.yaml:11: timeouts: inconsistent timeouts: connect_s (10) must be at most "
            "request_s (3); request_s (3) must be greater than heartbeat_s (5); upload_s (2) "
            "must be greater than request_s (3)",
        ),
        (
            {"extra": "workers:\n  count: 2\n  env: {OMP_NUM_THREADS: '8'}\n"},
            "agent.yaml:11: workers: env may not set OMP_NUM_THREADS",
        ),
        (
            {"extra": "workers: {count: many}\n"},
            "agent.yaml:11: workers.count: must be an integer >= 1 or 'auto', got 'many'",
        ),
        (
            {"extra": "workers: {backend: mpi}\n"},
            "agent.yaml:11: workers.backend: Input should be 'auto', 'gloo' or 'nccl'",
        ),
        (
            {"extra": "workers: {env: {'bad name': x}}\n"},
            "agent.yaml:11: workers.env: 'bad name' is not an environment variable name",
        ),
        (
            {"extra": "workers: {collective_timeout_s: 1}\n"},
            "agent.yaml:11: workers.collective_timeout_s: Input should be greater than or "
            "equal to 5",
        ),
        ({"extra": "state_dir: again\n"}, "agent.yaml:11: state_dir: duplicate key"),
        ({"extra": "datasets: [a, a]\n"}, "agent.yaml:11: datasets: a dataset is listed twice"),
    ],
)
def test_schema_errors_name_file_line_and_key(
    tmp_path: Path, federation: Federation, fields: dict[str, str], expected: str
) -> None:
    found = problems(write(tmp_path, federation, **fields))
    assert any(expected in problem for problem in found), found


@pytest.mark.parametrize(("count", "expected"), [("auto", "auto"), ("3", 3)])
def test_workers_count_reaches_the_launcher(
    tmp_path: Path, federation: Federation, count: str, expected: object
) -> None:
    config = load_config(write(tmp_path, federation, extra=f"workers: {{count: {count}}}\n"))
    assert config.workers.count == expected
    assert config.workers.launcher_config().nproc_per_node == expected


def test_workers_peak_flops_is_optional_and_positive(
    tmp_path: Path, federation: Federation
) -> None:
    assert load_config(write(tmp_path, federation)).workers.peak_flops is None
    config = load_config(write(tmp_path, federation, extra="workers: {peak_flops: 1.5e14}\n"))
    assert config.workers.peak_flops == 1.5e14
    found = problems(write(tmp_path, federation, extra="workers: {peak_flops: 0}\n"))
    assert any("agent.yaml:11: workers.peak_flops" in p for p in found), found


def test_every_schema_problem_is_reported_at_once(tmp_path: Path, federation: Federation) -> None:
    path = write(tmp_path, federation, mqtt="{port: 0}", extra="workers: {count: 0}\n")
    found = problems(path)
    assert any("agent.yaml:5: mqtt.port" in p for p in found)
    assert any("agent.yaml:11: workers.count" in p for p in found)


def test_a_missing_key_names_its_parent(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("federation: acme\nregion: eu-west\n")
    found = problems(path)
    assert f"{path}:1: coordinator_url: missing required key 'coordinator_url'" in found
    assert len(found) == 4  # policy, coordinator_url, identity, state_dir


def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("federation: acme\nregion: [eu-west\n")
    [problem] = problems(path)
    assert problem.startswith(f"{path}:")
    assert "(syntax)" in problem


def test_an_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    [problem] = problems(tmp_path / "missing.yaml")
    assert "missing.yaml: (file): cannot read" in problem


def test_the_policy_must_govern_this_region(tmp_path: Path, federation: Federation) -> None:
    found = problems(write(tmp_path, federation, policy=str(POLICIES / "us-east.yaml")))
    assert found == [
        f"{tmp_path / 'agent.yaml'}:3: policy: {POLICIES / 'us-east.yaml'} governs us-east, "
        "not eu-west"
    ]


def test_datasets_must_be_declared_by_the_policy(tmp_path: Path, federation: Federation) -> None:
    path = write(tmp_path, federation, extra="datasets: [eu-parliament-proceedings, us-books]\n")
    [problem] = problems(path)
    assert ":11: datasets[1]: eu-west's policy declares no dataset 'us-books'" in problem


def test_training_datasets_default_to_every_declared_dataset(
    tmp_path: Path, federation: Federation
) -> None:
    config = load_config(write(tmp_path, federation))
    assert training_datasets(config, region_policies(config)) == (
        "eu-parliament-proceedings",
        "eu-support-chats",
    )
    chosen = load_config(write(tmp_path, federation, extra="datasets: [eu-support-chats]\n"))
    assert training_datasets(chosen, region_policies(chosen)) == ("eu-support-chats",)


def test_datasets_may_say_where_their_files_are(tmp_path: Path, federation: Federation) -> None:
    (tmp_path / "data" / "chats").mkdir(parents=True)
    (tmp_path / "data" / "chats" / "a.jsonl").write_text('{"text": "hello"}\n')
    extra = (
        "datasets:\n"
        "  eu-support-chats: {path: data/chats, format: jsonl}\n"
        "  eu-parliament-proceedings:\n"
    )
    config = load_config(write(tmp_path, federation, extra=extra))
    assert training_datasets(config, region_policies(config)) == (
        "eu-parliament-proceedings",
        "eu-support-chats",
    )
    # Relative to the config file; tokens cached under the state directory by default.
    assert dataset_locations(config) == {
        "eu-support-chats": DatasetLocation(
            path=str(tmp_path / "data" / "chats"),
            format="jsonl",
            cache_dir=str(tmp_path / "state" / "datasets" / "eu-support-chats"),
        )
    }


def test_a_dataset_whose_files_are_missing_is_named_with_its_line(
    tmp_path: Path, federation: Federation
) -> None:
    extra = (
        "datasets:\n"
        "  eu-support-chats: {path: /nowhere/chats, format: parquet}\n"
        "  us-books: {path: /nowhere/books, format: text, colour: blue}\n"
    )
    found = problems(write(tmp_path, federation, extra=extra))
    [unknown] = found
    assert "datasets.us-books.colour" in unknown
    extra = "datasets:\n  eu-support-chats: {path: /nowhere/chats, format: parquet}\n"
    [problem] = problems(write(tmp_path, federation, extra=extra))
    assert problem == (
        f"{tmp_path / 'agent.yaml'}:12: datasets.eu-support-chats.path: "
        "dataset /nowhere/chats: no such file or directory"
    )


def test_missing_identity_files_are_named(tmp_path: Path, federation: Federation) -> None:
    missing = tmp_path / "nope.pem"
    found = problems(write(tmp_path, federation, cert=str(missing)))
    assert found == [
        f"{tmp_path / 'agent.yaml'}:7: identity.cert: {missing} is not a readable file"
    ]


def test_a_certificate_of_another_region_is_refused(tmp_path: Path, federation: Federation) -> None:
    other = credential_dir(federation, "region-us-east")
    path = write(tmp_path, federation, cert=str(other / "cert.pem"), key=str(other / "key.pem"))
    [problem] = problems(path)
    assert ":6: identity: " in problem
    assert "is spiffe://acme/region/us-east, but this agent is spiffe://acme/region/eu-west" in (
        problem
    )


def test_a_key_that_does_not_match_the_certificate_is_refused(
    tmp_path: Path, federation: Federation
) -> None:
    other = credential_dir(federation, "region-us-east")
    [problem] = problems(write(tmp_path, federation, key=str(other / "key.pem")))
    assert "is not the ECDSA key of" in problem


def test_a_trust_bundle_of_another_federation_is_refused(
    tmp_path: Path, federation: Federation
) -> None:
    other = make_federation(tmp_path / "other", "otherfed")
    [problem] = problems(write(tmp_path, federation, bundle=str(other.bundle_file)))
    assert "is for federation 'otherfed', not 'acme'" in problem


def test_load_credentials_gives_the_region_key_and_bundle(
    tmp_path: Path, federation: Federation
) -> None:
    config = load_config(write(tmp_path, federation))
    credentials = load_credentials(config.identity, config.identity_uri)
    assert credentials.identity.uri == "spiffe://acme/region/eu-west"
    assert credentials.bundle.federation == "acme"
    assert credentials.private_key.public_key() == credentials.certificate.public_key()
    assert issubclass(CredentialsError, ValueError)


def test_geofed_agent_exits_2_on_a_config_error(
    tmp_path: Path, federation: Federation, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, federation, mqtt="{host: h, port: 0}")
    assert geofed_main(["agent", "--config", str(path)]) == 2
    assert f"error: {path}:5: mqtt.port" in capsys.readouterr().err


@pytest.fixture(scope="module")
def demo_layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of configs/ next to run/pki/, made with the commands the examples document."""
    root = tmp_path_factory.mktemp("demo")
    shutil.copytree(REPO / "configs", root / "configs")
    pki = root / "run" / "pki"
    assert geofed_main(["ca", "init", "--federation", "demo", "--out", str(pki / "ca")]) == 0
    for region in ("eu-west", "us-east", "ap-south"):
        issue = ["ca", "issue", "--ca", str(pki / "ca"), "--role", "region", "--name", region]
        assert geofed_main([*issue, "--out", str(pki / region)]) == 0
    return root


@pytest.mark.parametrize("region", ["eu-west", "us-east", "ap-south"])
def test_the_example_configs_load_in_the_demo_layout(demo_layout: Path, region: str) -> None:
    config = load_config(demo_layout / "configs" / f"agent-{region}.yaml")
    assert config.region == region
    assert config.federation == "demo"
    credentials = load_credentials(config.identity, config.identity_uri)
    assert credentials.identity.uri == f"spiffe://demo/region/{region}"
    datasets = training_datasets(config, region_policies(config))
    assert len(datasets) == 1
    assert config.state_dir.resolve() == (demo_layout / "run" / "agents" / region).resolve()


def test_transfer_windows_default_and_are_bounded(tmp_path: Path, federation: Federation) -> None:
    config = load_config(write(tmp_path, federation))
    assert (config.transfer.upload_window, config.transfer.download_window) == (8, 4)
    config = load_config(write(tmp_path, federation, extra="transfer: {upload_window: 1}\n"))
    assert config.transfer.upload_window == 1
    for bad in ("transfer: {upload_window: 0}\n", "transfer: {download_window: 33}\n"):
        found = problems(write(tmp_path, federation, extra=bad))
        assert any("agent.yaml:11: transfer." in p for p in found), found
    found = problems(write(tmp_path, federation, extra="transfer: {window: 4}\n"))
    assert any("agent.yaml:11: transfer.window" in p for p in found), found


def test_drain_grace_defaults_to_two_minutes_and_is_bounded(
    tmp_path: Path, federation: Federation
) -> None:
    config = load_config(write(tmp_path, federation))
    assert config.drain.grace_s == 120
    config = load_config(write(tmp_path, federation, extra="drain: {grace_s: 0}\n"))
    assert config.drain.grace_s == 0
    for bad in ("drain: {grace_s: -1}\n", "drain: {grace_s: 3601}\n", "drain: {grace: 5}\n"):
        found = problems(write(tmp_path, federation, extra=bad))
        assert any("agent.yaml:11: drain." in p for p in found), found


def test_a_trace_collectors_ca_is_resolved_beside_the_file_and_must_exist(
    tmp_path: Path, federation: Federation
) -> None:
    extra = "tracing: {otlp_endpoint: 'https://otel:4318/v1/traces', certificate_file: ca.pem}\n"
    found = problems(write(tmp_path, federation, extra=extra))
    assert found == [
        f"{tmp_path / 'agent.yaml'}:11: tracing.certificate_file: {tmp_path / 'ca.pem'} is not "
        "a readable file"
    ]
    (tmp_path / "ca.pem").write_text("a CA bundle\n")
    config = load_config(write(tmp_path, federation, extra=extra))
    assert config.tracing.certificate_file == tmp_path / "ca.pem"
