"""The regional agent's configuration: one YAML file, validated once at start-up.

.. code-block:: yaml

    federation: acme                  # the federation name in every SPIFFE URI and topic
    region: eu-west                   # this region; its policy file must govern it
    policy: policies/eu-west.yaml     # the region's own policy, checked before uploads
    datasets: [eu-support-chats]      # optional: the datasets this region trains on
                                      #   (default: every dataset its policy declares)
    # or, where the job's task reads the region's own files, where each one lives:
    # datasets:
    #   eu-support-chats: {path: /data/chats/, format: parquet, text_field: text}
    #   (format: parquet | jsonl | text | tokens; tokens: dtype uint16 | uint32;
    #    cache_dir: where text is tokenized once, default <state_dir>/datasets/<name>)
    coordinator_url: https://coordinator.acme.example:8443
    mqtt: {host: mqtt.acme.example, port: 8883, tls: true}
    identity:                         # the region's credential (geofed ca issue)
      cert: pki/region-eu-west/cert.pem
      key: pki/region-eu-west/key.pem
      trust_bundle: pki/trust.yaml
    insecure_loopback: false          # demo only: plain HTTP to a loopback coordinator
    workers:                          # the worker group
      count: auto                     # ranks per node (or nproc_per_node); auto: one per
                                      #   visible GPU on nccl, 2 on gloo
      backend: auto                   # auto | gloo | nccl
      env: {NCCL_SOCKET_IFNAME: eth0} # extra environment for the workers
      env_passthrough: ["NCCL_*", GLOO_SOCKET_IFNAME]  # agent variables for the workers
      launcher: local                 # local | slurm
      nnodes: 1                       # nodes; local with > 1: rdzv_endpoint and rdzv_id
      slurm: {rdzv_port: 29400}       # slurm: rdzv_port, partition, time_limit, extra_args
      peak_flops: 989.0e+12           # optional: one device's peak FLOPs/s, for the MFU
    state_dir: /var/lib/geofed/eu-west
    timeouts: {request_s: 30, upload_s: 300}
    metrics: {enabled: true, host: 127.0.0.1, port: 9443}   # /metrics and /healthz, mTLS
    transfer: {upload_window: 8, download_window: 4}         # requests in flight at once
    drain: {grace_s: 120}             # SIGTERM: finish the round if it fits (default 120 s)
    log_level: INFO                   # optional; a reload (SIGHUP) applies a change

Relative paths are relative to the config file's directory. Unknown and duplicate keys
are errors, and every error names the file, the line and the key
(``agent.yaml:7: mqtt.port: ...``). The identity is always needed: manifests are signed
with it and the coordinator's are verified against the trust bundle, whatever the
transport. ``insecure_loopback`` replaces only the HTTP transport (plain HTTP with an
``X-Geofed-Identity`` header instead of a client certificate) and is refused unless the
coordinator is on a loopback address; ``mqtt.tls: false`` likewise only for a loopback
broker (the embedded demo broker). The ``metrics`` listener is HTTPS with the region's
certificate and client certificates required in every mode, the demo's included.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)
from yarl import URL

from geofed.config_sections import ConfigSection, MqttConfig
from geofed.data.location import DataError, DatasetLocation, dataset_files
from geofed.located_yaml import KeyPath, LineMap, format_key_path
from geofed.loopback import is_loopback
from geofed.reload import LogLevel
from geofed.timeouts import Timeouts
from geofed.tracing import TracingConfig
from geofed.types import Identity, Role, validate_name
from policies import PolicyLoadError, PolicySet, Problem, load_policies
from policies.validation import validate_document
from policies.yaml_loader import load_located
from regional_agent.credentials import AgentIdentityConfig, CredentialsError, load_credentials
from regional_agent.drain import DrainConfig
from regional_agent.handoff.settings import (
    DEFAULT_REGIONAL_CHECKPOINT_EVERY,
    MIN_COLLECTIVE_TIMEOUT_S,
    LauncherConfigError,
)
from regional_agent.launch.exclusion import StragglerExclusionConfig
from regional_agent.launch.launcher import LocalLauncherConfig
from regional_agent.launch.ranks import AUTO
from regional_agent.launch.spec import check_env_patterns, parse_endpoint, passthrough_env
from regional_agent.transfer.config import TransferConfig

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class AgentConfigError(Exception):
    """The agent's configuration (or a file it names) is unusable; ``problems`` says where."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems: tuple[Problem, ...] = tuple(problems)
        if not self.problems:
            raise ValueError("AgentConfigError needs at least one problem")
        more = len(self.problems) - 1
        suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
        super().__init__(f"{self.problems[0]}{suffix}")


Name = Annotated[str, Field(min_length=1, max_length=63)]


class MetricsConfig(ConfigSection):
    """The operations listener: ``/metrics`` and ``/healthz`` over mutual TLS.

    It presents the region's identity certificate (issue it with the DNS name Prometheus
    scrapes, ``geofed ca issue ... --dns``) and requires a client certificate of the
    federation; observers, operators and coordinators may read the metrics.
    """

    enabled: StrictBool = Field(default=True, description="serve /metrics and /healthz")
    host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="address to listen on; 0.0.0.0 or the host's address for a remote scraper",
    )
    port: StrictInt = Field(default=9443, ge=0, le=65535, description="0: any free port")

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        if any(c.isspace() for c in value) or "/" in value:
            raise ValueError(f"{value!r} is not a host name or address")
        return value


class SlurmConfig(ConfigSection):
    """How the ``slurm`` launcher asks Slurm for the worker group's job step."""

    rdzv_port: StrictInt = Field(
        default=29400, ge=1, le=65535, description="rendezvous port on the step's first node"
    )
    partition: str | None = Field(
        default=None, min_length=1, description="for an allocation srun requests itself"
    )
    time_limit: str | None = Field(default=None, min_length=1, description="srun --time")
    extra_args: tuple[str, ...] = Field(
        default=(), description="more srun options, e.g. --gpus-per-node=8, --account=..."
    )

    @field_validator("extra_args")
    @classmethod
    def _options(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for arg in value:
            if not arg.startswith("-"):
                raise ValueError(f"{arg!r} is not an srun option (options start with -)")
        return value


class WorkersConfig(ConfigSection):
    """The worker group (torch.distributed) the agent launches and supervises."""

    count: int | Literal["auto"] = Field(
        default=AUTO,
        description="ranks on each node; auto: one per visible GPU on nccl, 2 on gloo",
    )
    nproc_per_node: int | Literal["auto"] | None = Field(
        default=None, description="another name of count (torchrun's); give one of them"
    )
    nnodes: StrictInt = Field(default=1, ge=1, description="nodes of the group")
    launcher: Literal["local", "slurm"] = Field(
        default="local",
        description="local: this node's elastic launcher (the other nodes run "
        "regional_agent.launch.node); slurm: srun starts every node",
    )
    rdzv_endpoint: str | None = Field(
        default=None,
        description="local: host:port of the head node's rendezvous (needed for nnodes > 1); "
        "default 127.0.0.1 and a free port",
    )
    rdzv_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="local, nnodes > 1: the rendezvous id all nodes are given",
    )
    local_addr: str | None = Field(
        default=None, min_length=1, description="this node's address as the others reach it"
    )
    env_passthrough: tuple[str, ...] = Field(
        default=("NCCL_*", "GLOO_SOCKET_IFNAME"),
        description="the agent's own variables (names, or PREFIX* patterns) given to the "
        "workers of every node, e.g. NCCL_IB_HCA, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME",
    )
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="auto: nccl when CUDA is available, else gloo"
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="extra worker environment, e.g. NCCL_SOCKET_IFNAME, NCCL_IB_HCA",
    )
    max_restarts: StrictInt = Field(
        default=3, ge=0, description="in-place restarts of the group by the elastic launcher"
    )
    max_relaunches: StrictInt = Field(
        default=3, ge=0, description="relaunches after the launcher gave up, before failing"
    )
    num_threads: StrictInt = Field(default=1, ge=1, description="torch threads per worker")
    peak_flops: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description=(
            "peak FLOPs/s of one rank's device, for the MFU estimate; default: the data "
            "sheet figure of known GPUs, and no MFU on other devices (the CPU)"
        ),
    )
    start_timeout_s: float = Field(default=300.0, gt=0, allow_inf_nan=False)
    collective_timeout_s: float = Field(
        default=600.0, ge=MIN_COLLECTIVE_TIMEOUT_S, allow_inf_nan=False
    )
    stragglers: StragglerExclusionConfig = Field(
        default_factory=StragglerExclusionConfig,
        description="whether a node whose ranks straggle is left out of the group "
        "(regional_agent.launch.exclusion)",
    )
    regional_checkpoint_every: StrictInt = Field(
        default=DEFAULT_REGIONAL_CHECKPOINT_EVERY,
        ge=1,
        le=1 << 20,
        description="rounds between saves of the inner optimizer state (sharded, each rank "
        "its part); the group also saves when it parks a job and when it stops (then with "
        "the error-feedback residual's tensors, which rank 0 holds between)",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_count(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("nproc_per_node") is not None:
            if "count" in data:
                raise ValueError("give count or nproc_per_node, not both")
            data = {**data, "count": data["nproc_per_node"]}
        return data

    @field_validator("count", "nproc_per_node", mode="before")
    @classmethod
    def _count(cls, value: object) -> object:
        if value is None or value == AUTO or (type(value) is int and value >= 1):
            return value
        raise ValueError(f"must be an integer >= 1 or {AUTO!r}, got {value!r}")

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            parse_endpoint(value)
        return value

    @field_validator("env_passthrough")
    @classmethod
    def _passthrough(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        check_env_patterns(value)
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _ENV_NAME.fullmatch(key):
                raise ValueError(f"{key!r} is not an environment variable name")
        return value

    def launcher_config(
        self, cwd: Path | None = None, environ: Mapping[str, str] | None = None
    ) -> LocalLauncherConfig:
        """The head node's launcher settings; raises ``LauncherConfigError`` if they clash.

        ``environ`` is the agent's environment: the variables ``env_passthrough`` names
        are taken from it (``env`` wins over them).
        """
        passed = {} if environ is None else passthrough_env(environ, self.env_passthrough)
        return LocalLauncherConfig(
            nproc_per_node=self.count,
            max_restarts=self.max_restarts,
            backend=None if self.backend == "auto" else self.backend,
            env={**passed, **self.env},
            num_threads=self.num_threads,
            collective_timeout_s=self.collective_timeout_s,
            regional_checkpoint_every=self.regional_checkpoint_every,
            cwd=cwd,
            nnodes=self.nnodes,
            rdzv_endpoint=self.rdzv_endpoint,
            rdzv_id=self.rdzv_id,
            local_addr=self.local_addr,
        )

    @model_validator(mode="after")
    def _launcher_accepts(self) -> WorkersConfig:
        if self.stragglers.exclude and self.launcher != "slurm":
            raise ValueError(
                "stragglers.exclude needs the slurm launcher, which starts every node itself "
                "(the local launcher's other nodes are started by their own hosts)"
            )
        if self.stragglers.min_nodes > self.nnodes:
            raise ValueError(
                f"stragglers.min_nodes ({self.stragglers.min_nodes}) exceeds nnodes ({self.nnodes})"
            )
        if self.launcher == "slurm" and (self.rdzv_endpoint or self.rdzv_id):
            raise ValueError(
                "rdzv_endpoint and rdzv_id are for the local launcher: under slurm the "
                "rendezvous is at the job step's first node, port slurm.rdzv_port"
            )
        if (
            self.launcher == "local"
            and self.nnodes > 1
            and not (self.rdzv_endpoint and self.rdzv_id)
        ):
            raise ValueError(
                "nnodes > 1 with the local launcher needs rdzv_endpoint (host:port of this "
                "head node, where the other nodes' regional_agent.launch.node meet it) and "
                "rdzv_id"
            )
        try:
            self.launcher_config()
        except LauncherConfigError as exc:
            raise ValueError(str(exc)) from None
        return self


class AgentConfig(ConfigSection):
    """Everything one regional agent needs to know, checked once at load."""

    federation: Name
    region: Name
    policy: Path = Field(description="the region's policy file")
    datasets: dict[Name, DatasetLocation | None] | None = Field(
        default=None,
        description="datasets trained on here, a list of names or a mapping of name -> "
        "where its files are (path, format, text_field, dtype, cache_dir); default: all "
        "the policy declares, without files",
    )
    coordinator_url: str = Field(description="base URL of the coordinator's HTTP API")
    mqtt: MqttConfig = Field(default_factory=MqttConfig)
    identity: AgentIdentityConfig
    insecure_loopback: StrictBool = False
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    state_dir: Path
    timeouts: Timeouts = Field(default_factory=Timeouts)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    drain: DrainConfig = Field(default_factory=DrainConfig)
    tracing: TracingConfig = Field(
        default_factory=TracingConfig,
        description="where the region's round spans go over OTLP/HTTP (geofed.tracing); "
        "default: nowhere",
    )
    log_level: LogLevel | None = Field(
        default=None,
        description="DEBUG, INFO, WARNING or ERROR; default: the command line's --log-level; "
        "a reload (SIGHUP) applies a change",
    )

    @field_validator("federation")
    @classmethod
    def _federation(cls, value: str) -> str:
        return validate_name("federation", value)

    @field_validator("region")
    @classmethod
    def _region(cls, value: str) -> str:
        return validate_name("region", value)

    @field_validator("datasets", mode="before")
    @classmethod
    def _datasets(cls, value: object) -> object:
        if isinstance(value, list | tuple):
            if len(set(map(str, value))) != len(value):
                raise ValueError("a dataset is listed twice")
            return dict.fromkeys(value)
        return value

    @field_validator("coordinator_url")
    @classmethod
    def _url(cls, value: str) -> str:
        url = URL(value)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"{value!r} is not an http:// or https:// URL with a host")
        if url.query_string or url.fragment:
            raise ValueError(f"{value!r}: a base URL has no query or fragment")
        return value

    @model_validator(mode="after")
    def _transport(self) -> AgentConfig:
        url = URL(self.coordinator_url)
        if not self.insecure_loopback:
            if url.scheme != "https":
                raise ValueError(
                    f"coordinator_url {self.coordinator_url!r} must be https:// "
                    "(plain http only with insecure_loopback: true)"
                )
            return self
        if url.scheme != "http":
            raise ValueError("insecure_loopback: true speaks plain http://, not https://")
        if not is_loopback(url.host or ""):
            raise ValueError(
                f"insecure_loopback: true, but the coordinator_url host {url.host!r} is not a "
                "loopback address; plain HTTP leaves no machine"
            )
        return self

    @property
    def identity_uri(self) -> Identity:
        """This region's federation identity, ``spiffe://<federation>/region/<region>``."""
        return Identity(federation=self.federation, role=Role.REGION, name=self.region)

    @property
    def workers_dir(self) -> Path:
        """The worker group's hand-off directory, inside the state directory."""
        return self.state_dir / "workers"


_PATH_FIELDS: tuple[KeyPath, ...] = (
    ("policy",),
    ("state_dir",),
    ("identity", "cert"),
    ("identity", "key"),
    ("identity", "trust_bundle"),
)


def load_config(path: Path | str) -> AgentConfig:
    """Read, validate and resolve the agent's config file; check the files it names.

    Raises :class:`AgentConfigError` listing every problem with its file, line and key:
    YAML or schema errors, a policy file that does not load or governs another region, a
    dataset the policy does not declare, an unreadable trust bundle or credential, or a
    credential that is not this region's.
    """
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AgentConfigError([Problem(file, None, "(file)", f"cannot read: {exc}")]) from None
    try:
        document = load_located(text, file)
        raw = validate_document(AgentConfig, document, file)
    except PolicyLoadError as exc:
        raise AgentConfigError(exc.problems) from None
    config = _resolve(raw, Path(path).resolve().parent)
    _check_files(config, file, document.lines)
    return config


def _resolve(config: AgentConfig, base: Path) -> AgentConfig:
    def absolute(value: Path) -> Path:
        return value if value.is_absolute() else base / value

    identity = config.identity.model_copy(
        update={
            "cert": absolute(config.identity.cert),
            "key": absolute(config.identity.key),
            "trust_bundle": absolute(config.identity.trust_bundle),
        }
    )
    state_dir = absolute(config.state_dir)
    datasets = None
    if config.datasets is not None:
        datasets = {
            name: None if loc is None else loc.resolved(base, state_dir / "datasets" / name)
            for name, loc in config.datasets.items()
        }
    return config.model_copy(
        update={
            "policy": absolute(config.policy),
            "state_dir": state_dir,
            "identity": identity,
            "datasets": datasets,
            "tracing": config.tracing.resolved(absolute),
        }
    )


def _check_files(config: AgentConfig, file: str, lines: LineMap) -> None:
    def problem(key: KeyPath, message: str) -> Problem:
        return Problem(file, lines.line_of(key), format_key_path(key), message)

    problems: list[Problem] = []
    for key in _PATH_FIELDS:
        if key == ("state_dir",):
            continue
        value: object = config
        for part in key:
            value = getattr(value, str(part))
        if not isinstance(value, Path) or not value.is_file():
            problems.append(problem(key, f"{value} is not a readable file"))
    ca = config.tracing.certificate_file
    if ca is not None and not ca.is_file():
        problems.append(problem(("tracing", "certificate_file"), f"{ca} is not a readable file"))
    if problems:
        raise AgentConfigError(problems)
    try:
        policies = load_region_policies(config)
    except PolicyLoadError as exc:
        raise AgentConfigError(
            [problem(("policy",), f"policy file does not load: {p}") for p in exc.problems]
        ) from None
    if config.region not in policies:
        found = ", ".join(policies) or "none"
        raise AgentConfigError(
            [problem(("policy",), f"{config.policy} governs {found}, not {config.region}")]
        )
    declared = {d.name for d in policies[config.region].policy.datasets}
    listed = ("datasets", 0) in lines.lines
    for index, (name, location) in enumerate((config.datasets or {}).items()):
        at: KeyPath = ("datasets", index) if listed else ("datasets", name)
        if name not in declared:
            problems.append(
                problem(
                    at,
                    f"{config.region}'s policy declares no dataset {name!r} "
                    f"(it declares {', '.join(sorted(declared)) or 'none'})",
                )
            )
        if location is not None:
            try:
                dataset_files(location)
            except DataError as exc:
                problems.append(problem((*at, "path"), str(exc)))
    try:
        load_credentials(config.identity, config.identity_uri)
    except CredentialsError as exc:
        problems.append(problem(("identity",), str(exc)))
    if problems:
        raise AgentConfigError(problems)


def load_region_policies(config: AgentConfig) -> PolicySet:
    """Load the region's own policy file (``PolicyLoadError`` on any problem)."""
    return load_policies([config.policy])


def training_datasets(config: AgentConfig, policies: PolicySet) -> tuple[str, ...]:
    """The datasets this region's deltas derive from: the configured ones, else all declared."""
    if config.datasets is not None:
        return tuple(sorted(config.datasets))
    return tuple(sorted(d.name for d in policies[config.region].policy.datasets))


def dataset_locations(config: AgentConfig) -> dict[str, DatasetLocation]:
    """Where this region keeps each dataset the config gives files for, by name."""
    return {name: loc for name, loc in (config.datasets or {}).items() if loc is not None}


__all__ = [
    "AgentConfig",
    "AgentConfigError",
    "MetricsConfig",
    "SlurmConfig",
    "WorkersConfig",
    "dataset_locations",
    "load_config",
    "load_region_policies",
    "training_datasets",
]
