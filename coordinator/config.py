"""The coordinator's configuration file: one typed model, validated once at start-up.

YAML, unknown keys are errors, and every error names the file, the line and the key
(``coordinator.yaml:14: timeouts: inconsistent timeouts: upload_s (30) must be greater
than request_s (60)``). Relative paths are relative to the file's own directory.

.. code-block:: yaml

    federation: acme                  # the federation this coordinator serves
    jurisdiction: EU                  # where the coordinator runs (policies match on it)
    listen: {host: 0.0.0.0, port: 8443}
    trust_bundle: pki/trust.yaml      # trusted CAs: TLS peers and manifest signers
    identity: {cert: pki/coordinator/cert.pem, key: pki/coordinator/key.pem}
    tls: {}                           # HTTPS with client certificates (default: identity's)
    # insecure_loopback: true         # plain HTTP on 127.0.0.1, demo only (no tls section)
    mqtt: {host: broker.acme.example, port: 8883, tls: true}
    state_dir: /var/lib/geofed/coordinator
    # state_store: {kind: postgresql, dsn: "host=db.acme.example dbname=geofed user=geofed",
    #               leader_lease: {ttl_s: 15}}   # two or more coordinators: one leads
    policies_dir: /etc/geofed/policies
    storage:
      - {name: eu-ckpt, jurisdiction: EU, path: /srv/checkpoints/eu}
    timeouts: {heartbeat_s: 5, request_s: 30, upload_s: 300, download_s: 300,
               round_deadline_s: 1800}
    limits: {max_upload_bytes: 2147483648, max_manifest_bytes: 16777216}
    publication_retry: {initial_s: 5, max_s: 300, max_attempts: 10}
    import_dirs: [/srv/models]        # exported models a job's init_from.path may name
    task_modules: [acme_tasks.*]      # task modules jobs may name, besides geofed.examples.*
                                      #   and geofed.tasks.*
    scheduling: scheduling.yaml       # optional: priority classes and quotas for admission
    admins: [ops-lead]                # optional: operators that manage every team's jobs
    log_level: INFO                   # optional; a reload (SIGHUP) applies a change
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from coordinator.costs.prices import PriceTable
from coordinator.rounds.quarantine import QuarantineConfig
from geofed.backoff import Backoff
from geofed.config_sections import ConfigSection, IdentityConfig, MqttConfig
from geofed.loopback import is_loopback
from geofed.manifest import MAX_SIGNED_MANIFEST_BYTES
from geofed.reload import LogLevel
from geofed.task import DEFAULT_TASK_MODULES, validate_module_pattern
from geofed.timeouts import Timeouts
from geofed.tracing import TracingConfig
from geofed.types import validate_name
from policies.destinations import validate_jurisdiction
from policies.errors import PolicyLoadError, Problem
from policies.validation import validate_document
from policies.yaml_loader import load_located

__all__ = [
    "ConfigError",
    "CoordinatorConfig",
    "CoordinatorMqttConfig",
    "LimitsConfig",
    "ListenConfig",
    "PublicationRetryConfig",
    "StorageConfig",
    "TlsConfig",
    "load_config",
    "parse_config",
]


class ConfigError(Exception):
    """The configuration is unusable; ``problems`` lists every ``file:line: key: message``."""

    def __init__(self, problems: list[str]) -> None:
        if not problems:
            raise ValueError("ConfigError needs at least one problem")
        self.problems = tuple(problems)
        more = len(problems) - 1
        super().__init__(problems[0] + (f" (and {more} more)" if more else ""))


def _federation(value: str) -> str:
    return validate_name("federation", value)


def _storage_name(value: str) -> str:
    return validate_name("storage location", value)


def _region(value: str) -> str:
    return validate_name("region", value)


def _coordinator_name(value: str) -> str:
    return validate_name("coordinator name", value)


def _admin_name(value: str) -> str:
    return validate_name("admin operator name", value)


def _team_name(value: str) -> str:
    return validate_name("team", value)


def _export_destination(value: str) -> str:
    kind, sep, rest = value.partition(":")
    if sep and kind == "storage":
        validate_name("storage location", rest)
    elif sep and kind == "jurisdiction":
        validate_jurisdiction(rest)
    else:
        raise ValueError("an export destination is storage:NAME or jurisdiction:CODE")
    return value


FederationName = Annotated[str, AfterValidator(_federation)]
Jurisdiction = Annotated[str, AfterValidator(validate_jurisdiction)]
ExportDestination = Annotated[str, AfterValidator(_export_destination)]


class ListenConfig(ConfigSection):
    """Where the HTTPS API listens."""

    host: str = Field(default="127.0.0.1", min_length=1, description="address to bind")
    port: int = Field(default=8443, ge=0, le=65535, description="TCP port; 0 picks a free one")


class TlsConfig(ConfigSection):
    """HTTPS server credential; client certificates are always required."""

    cert: Path | None = Field(default=None, description="default: identity.cert")
    key: Path | None = Field(default=None, description="default: identity.key")


class CoordinatorMqttConfig(MqttConfig):
    """The control-plane broker, and the client id the coordinator connects with."""

    client_id: str | None = Field(
        default=None, max_length=128, description="default: coordinator-<name>"
    )


class StorageConfig(ConfigSection):
    """A storage location the coordinator may write global checkpoints to."""

    name: Annotated[str, AfterValidator(_storage_name)] = Field(
        description="as declared in a region policy's storage list (or a new name)"
    )
    jurisdiction: Jurisdiction = Field(description="where the bytes physically live")
    path: Path = Field(description="directory of the checkpoint store")
    region: Annotated[str, AfterValidator(_region)] | None = Field(
        default=None, description="owning region, if any (declared locations take it from there)"
    )


class LeaderLeaseConfig(ConfigSection):
    """Coordinators sharing one PostgreSQL state: one leads, the others stand by."""

    ttl_s: float = Field(
        default=15.0,
        gt=0,
        le=3600,
        description="how long a lease lasts unless renewed: a standby takes over at most "
        "this long after the leader's loss",
    )
    renew_every_s: float | None = Field(
        default=None, gt=0, description="how often the leader renews (default: ttl_s / 3)"
    )
    name: str = Field(
        default="coordinator",
        min_length=1,
        max_length=128,
        description="the lease's name: coordinators of one federation share it",
    )

    @property
    def renew_interval_s(self) -> float:
        return self.ttl_s / 3 if self.renew_every_s is None else self.renew_every_s

    @model_validator(mode="after")
    def _renews_in_time(self) -> Self:
        if self.renew_interval_s * 2 > self.ttl_s:
            raise ValueError(
                f"renew_every_s ({self.renew_interval_s:g}) must be at most half of ttl_s "
                f"({self.ttl_s:g}), so one failed renewal does not lose the lease"
            )
        return self


class StateStoreConfig(ConfigSection):
    """Where the coordinator keeps jobs, rounds, receipts, pointers and the audit log."""

    kind: Literal["sqlite", "postgresql"] = Field(
        default="sqlite",
        description="'sqlite': <state_dir>/coordinator.db (one machine); 'postgresql': a "
        "server named by dsn, so that the state outlives the coordinator's machine",
    )
    dsn: str | None = Field(
        default=None,
        max_length=4096,
        description="postgresql: a libpq connection string, e.g. 'host=db.acme.example "
        "dbname=geofed user=geofed sslmode=verify-full'; without a password (use a "
        "~/.pgpass file, PGPASSFILE or a client certificate)",
    )
    leader_lease: LeaderLeaseConfig | None = Field(
        default=None,
        description="postgresql: run two or more coordinators on the same database; the "
        "one holding this lease serves, the others wait to take over",
    )

    @model_validator(mode="after")
    def _dsn_fits_kind(self) -> Self:
        if self.kind == "sqlite":
            if self.dsn is not None:
                raise ValueError("dsn is for kind: postgresql; sqlite lives in state_dir")
            if self.leader_lease is not None:
                raise ValueError(
                    "leader_lease needs kind: postgresql (coordinators must share the state)"
                )
            return self
        if not self.dsn:
            raise ValueError("kind: postgresql needs a dsn (a libpq connection string)")
        try:
            from psycopg.conninfo import conninfo_to_dict
        except ImportError:
            raise ValueError(
                "kind: postgresql needs psycopg 3: pip install 'geofed[postgres]'"
            ) from None
        try:
            parts = conninfo_to_dict(self.dsn)
        except Exception as exc:  # psycopg.ProgrammingError: the string does not parse
            raise ValueError(f"dsn is not a libpq connection string: {exc}") from None
        if parts.get("password"):
            raise ValueError(
                "dsn holds a password: keep it out of the config file (~/.pgpass, "
                "PGPASSFILE or a client certificate)"
            )
        return self


class LimitsConfig(ConfigSection):
    """Bounds on what a client may send."""

    max_upload_bytes: int = Field(
        default=2 << 30, ge=1024, description="largest delta stream (sum of its frames), bytes"
    )
    max_manifest_bytes: int = Field(
        default=1 << 24,
        ge=1024,
        le=MAX_SIGNED_MANIFEST_BYTES,
        description="largest signed manifest, bytes",
    )
    max_chunk_bytes: int = Field(
        default=64 << 20, ge=1024, description="largest single frame of a delta stream, bytes"
    )
    max_job_spec_bytes: int = Field(
        default=1 << 20, ge=1024, description="largest job spec body, bytes"
    )
    max_parameters: int = Field(
        default=2_000_000_000,
        ge=1,
        le=10**15,
        description="the most parameters a job's model may have: the coordinator holds a "
        "few float32 copies of it, so a larger one is refused at submission, counted on "
        "the meta device before anything is allocated",
    )
    max_task_bytes: int = Field(
        default=32 << 30,
        ge=1 << 20,
        description="the most resident memory a process running a job's task code for the "
        "coordinator may take: the child that builds the initial parameters of a model "
        "larger than 64M parameters or one the meta device cannot build "
        "(coordinator.jobs.initial_build), and the evaluation process; stopped past it",
    )
    build_timeout_s: float = Field(
        default=900.0,
        gt=0,
        le=86400,
        allow_inf_nan=False,
        description="the longest such a child build may take, seconds",
    )


class HardwareRiskConfig(ConfigSection):
    """The ``hardware_risk`` section: when a risky region is drained
    (:mod:`coordinator.scheduling.hardware_risk`)."""

    drain_at: float | None = Field(
        default=0.9,
        ge=0.7,  # the score that snapshots at once: a drain never comes before it
        le=1.0,
        description="the hardware risk score at which a region is drained (it finishes its "
        "round and its agent stops, until an operator starts it again); at least 0.7, the "
        "score that snapshots at once; null: never drain",
    )


class PublicationRetryConfig(ConfigSection):
    """How a round whose publication failed (checkpoint storage trouble) is tried again.

    The n-th consecutive failure of a round's publication waits ``initial_s * 2**(n-1)``
    seconds, at most ``max_s``, before the next attempt; after ``max_attempts`` failed
    attempts the job fails. These failures do not count against the job's
    ``max_round_attempts``, which bounds rounds the regions could not complete.
    """

    initial_s: float = Field(
        default=5.0,
        ge=0.001,
        le=86400,
        allow_inf_nan=False,
        description="wait after the first failure",
    )
    max_s: float = Field(
        default=300.0, gt=0, le=86400, allow_inf_nan=False, description="longest wait"
    )
    max_attempts: int = Field(
        default=10, ge=1, le=10000, description="publication attempts of one round"
    )

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.max_s < self.initial_s:
            raise ValueError(
                f"max_s ({self.max_s:g}) must be at least initial_s ({self.initial_s:g})"
            )
        return self

    @property
    def backoff(self) -> Backoff:
        """The schedule as a back-off, without jitter (one coordinator retries, not a herd)."""
        return Backoff(initial_s=self.initial_s, max_s=self.max_s, multiplier=2.0, jitter=0.0)

    def delay_s(self, failures: int) -> float:
        """The wait after the ``failures``-th consecutive failed attempt (counted from 1)."""
        if failures < 1:
            raise ValueError(f"failures counts from 1, not {failures}")
        return self.backoff.ceiling(failures - 1)


class CoordinatorConfig(ConfigSection):
    """The whole coordinator configuration file (see the module docstring)."""

    federation: FederationName
    name: Annotated[str, AfterValidator(_coordinator_name)] = Field(
        default="main", description="coordinator/<name> of the identity certificate"
    )
    jurisdiction: Jurisdiction = Field(description="where the coordinator runs")
    listen: ListenConfig = Field(default_factory=ListenConfig)
    insecure_loopback: bool = Field(
        default=False,
        description="plain HTTP on a loopback address with identities taken from the "
        "X-Geofed-Identity header: the single-machine demo only",
    )
    tls: TlsConfig | None = Field(default=None, description="HTTPS settings (TLS is the default)")
    trust_bundle: Path = Field(description="federation trust bundle file")
    identity: IdentityConfig = Field(
        description="the coordinator's credential (geofed ca issue --role coordinator): its "
        "key signs every published update and checkpoint; its certificate naming "
        "spiffe://<federation>/coordinator/<name> is the TLS server certificate unless tls "
        "names another one"
    )
    mqtt: CoordinatorMqttConfig = Field(default_factory=CoordinatorMqttConfig)
    state_dir: Path = Field(description="SQLite database, spooled deltas and working blobs")
    state_store: StateStoreConfig = Field(
        default_factory=StateStoreConfig,
        description="the state store: SQLite in state_dir (default) or PostgreSQL",
    )
    policies_dir: Path = Field(description="directory of region policy files")
    storage: tuple[StorageConfig, ...] = Field(
        min_length=1, description="locations global checkpoints may be written to"
    )
    timeouts: Timeouts = Field(default_factory=Timeouts)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    quarantine: QuarantineConfig = Field(default_factory=QuarantineConfig)
    publication_retry: PublicationRetryConfig = Field(default_factory=PublicationRetryConfig)
    task_modules: tuple[Annotated[str, AfterValidator(validate_module_pattern)], ...] = Field(
        default=(),
        description="modules a job's task.spec may name besides geofed.examples.* and "
        "geofed.tasks.*: "
        "'package.module' or 'package.*'; a job naming any other module is refused before "
        "anything is imported",
    )
    import_dirs: tuple[Path, ...] = Field(
        default=(),
        description="directories whose exported models a job's init_from.path may name "
        "(default: none, files are not imported)",
    )
    scheduling: Path | None = Field(
        default=None,
        description="scheduling file: priority classes, ageing, team quotas "
        "(coordinator.scheduling.config); default: the built-in classes production, "
        "research (the default) and best-effort",
    )
    admins: tuple[Annotated[str, AfterValidator(_admin_name)], ...] = Field(
        default=(),
        description="operator names (operator/<name>) that manage every team's jobs and may "
        "preempt; other operators manage only their team's jobs (coordinator.scheduling.teams)",
    )
    export_destinations: dict[
        Annotated[str, AfterValidator(_team_name)], tuple[ExportDestination, ...]
    ] = Field(
        default_factory=dict,
        description="where each team's operators may export a job's model: team -> "
        "destinations (storage:NAME, jurisdiction:CODE), decided then by the residency "
        "policies; a team not listed exports nowhere; admins may name any destination "
        "(coordinator.scheduling.teams)",
    )
    prices: PriceTable | None = Field(
        default=None,
        description="what a GPU-hour, a GB sent and a GB-month stored cost per region and "
        "location (coordinator.costs.prices), for usage reports (GET /v1/usage, geofed "
        "usage); default: none, so reports count use without pricing it",
    )
    hardware_risk: HardwareRiskConfig = Field(
        default_factory=HardwareRiskConfig,
        description="what a region's hardware risk makes the coordinator do besides "
        "snapshots (coordinator.scheduling.hardware_risk)",
    )
    tracing: TracingConfig = Field(
        default_factory=TracingConfig,
        description="where the coordinator's round spans go over OTLP/HTTP (geofed.tracing); "
        "default: nowhere",
    )
    log_level: LogLevel | None = Field(
        default=None,
        description="DEBUG, INFO, WARNING or ERROR; default: the command line's --log-level; "
        "a reload (SIGHUP) applies a change",
    )

    @field_validator("insecure_loopback")
    @classmethod
    def _loopback_only(cls, value: bool, info: ValidationInfo) -> bool:
        listen = info.data.get("listen")
        if value and isinstance(listen, ListenConfig) and not is_loopback(listen.host):
            raise ValueError(
                f"insecure_loopback serves plain HTTP, so listen.host must be a loopback "
                f"address (127.0.0.1, ::1, localhost), not {listen.host!r}"
            )
        return value

    @field_validator("tls")
    @classmethod
    def _tls_xor_insecure(cls, value: TlsConfig | None, info: ValidationInfo) -> TlsConfig | None:
        if value is not None and info.data.get("insecure_loopback"):
            raise ValueError("tls and insecure_loopback: true exclude each other; remove one")
        return value

    @field_validator("storage")
    @classmethod
    def _unique_storage(cls, value: tuple[StorageConfig, ...]) -> tuple[StorageConfig, ...]:
        names = [entry.name for entry in value]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"storage names must be unique; repeated: {', '.join(repeated)}")
        return value

    @field_validator("prices")
    @classmethod
    def _priced_names(cls, value: PriceTable | None, info: ValidationInfo) -> PriceTable | None:
        if value is None:
            return value
        for region in [*value.regions, *value.coordinator.egress_per_gb]:
            if region != "default":
                _region(region)
        storage = info.data.get("storage") or ()
        known = {entry.name for entry in storage}
        unknown = sorted(set(value.storage) - known)
        if unknown:
            raise ValueError(
                f"prices.storage names {', '.join(unknown)}, which the storage section does "
                f"not configure (it has: {', '.join(sorted(known)) or 'none'})"
            )
        return value

    @property
    def allowed_task_modules(self) -> tuple[str, ...]:
        """Every task module pattern jobs may name: the examples and ``task_modules``."""
        return (*DEFAULT_TASK_MODULES, *self.task_modules)

    @property
    def tls_enabled(self) -> bool:
        return not self.insecure_loopback

    @property
    def tls_cert(self) -> Path:
        tls = self.tls or TlsConfig()
        return tls.cert or self.identity.cert

    @property
    def tls_key(self) -> Path:
        tls = self.tls or TlsConfig()
        return tls.key or self.identity.key

    @property
    def mqtt_client_id(self) -> str:
        return self.mqtt.client_id or f"coordinator-{self.name}"

    def storage_named(self, name: str) -> StorageConfig | None:
        return next((entry for entry in self.storage if entry.name == name), None)

    def resolved(self, base: Path) -> Self:
        """A copy with every relative path made relative to ``base`` (the file's directory)."""

        def fix(path: Path) -> Path:
            return Path(os.path.normpath(path if path.is_absolute() else base / path))

        tls = self.tls
        if tls is not None:
            tls = tls.model_copy(
                update={
                    "cert": fix(tls.cert) if tls.cert else None,
                    "key": fix(tls.key) if tls.key else None,
                }
            )
        update: dict[str, Any] = {
            "trust_bundle": fix(self.trust_bundle),
            "identity": self.identity.model_copy(
                update={"cert": fix(self.identity.cert), "key": fix(self.identity.key)}
            ),
            "tls": tls,
            "state_dir": fix(self.state_dir),
            "policies_dir": fix(self.policies_dir),
            "scheduling": fix(self.scheduling) if self.scheduling is not None else None,
            "import_dirs": tuple(fix(path) for path in self.import_dirs),
            "storage": tuple(s.model_copy(update={"path": fix(s.path)}) for s in self.storage),
            "tracing": self.tracing.resolved(fix),
        }
        return self.model_copy(update=update)


def parse_config(text: str, file: str, *, base: Path | None = None) -> CoordinatorConfig:
    """Parse and validate a configuration document; ``file`` names it in errors.

    Relative paths are resolved against ``base`` (default: the current directory).
    Raise :class:`ConfigError` listing every problem found.
    """
    try:
        document = load_located(text, file)
        config = validate_document(CoordinatorConfig, document, file)
    except PolicyLoadError as exc:
        raise ConfigError([str(problem) for problem in exc.problems]) from None
    return config.resolved(base if base is not None else Path.cwd())


def load_config(path: Path | str) -> CoordinatorConfig:
    """Read and validate the configuration file at ``path``."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        problem = Problem(str(file), None, "(file)", f"cannot read: {exc}")
        raise ConfigError([str(problem)]) from None
    return parse_config(text, str(file), base=file.resolve().parent)
