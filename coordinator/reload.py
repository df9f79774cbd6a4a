"""The coordinator's reload (SIGHUP): policies, trust bundle and log level, or nothing.

:func:`prepare_reload` (blocking: run it in a thread) reads the configuration file again
and, from the directories and files in force, the region policies (checked against the
storage locations as at start-up) and the trust bundle. If anything is unusable, the
reload is refused and nothing changes. :func:`apply_reload` then swaps them in on the
event loop: jobs admitted, uploads and downloads decided afterwards use the new policies,
and the next request is checked against the new revocations.

Other changed keys of the file (addresses, directories, timeouts, storage...), a new
identity certificate, a new set of governed regions and new trust authorities in TLS
handshakes need a restart; the reload says which and does not apply them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coordinator.config import ConfigError, CoordinatorConfig, load_config
from coordinator.runtime import Runtime, policies_with_locations
from coordinator.storage.artifacts import Location
from geofed.pki import PKIError, TrustBundle, load_trust_bundle, read_certificate
from geofed.reload import ReloadReport, apply_log_level, changed_keys, describe_bundle_reload
from policies import PolicySet

__all__ = ["PreparedReload", "apply_reload", "prepare_reload"]


@dataclass(frozen=True)
class PreparedReload:
    """What a reload read and checked; ``report.ok`` says whether it may be applied."""

    report: ReloadReport
    config: CoordinatorConfig | None = None
    policies: PolicySet | None = None
    bundle: TrustBundle | None = None


def prepare_reload(runtime: Runtime, config_path: Path | str) -> PreparedReload:
    """Read and check everything a reload would apply; nothing in ``runtime`` changes."""
    report = ReloadReport()
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        report.refused.extend(exc.problems)
        return PreparedReload(report)
    running = runtime.config
    restart = changed_keys(running, config, ignore={"log_level"})
    if restart:
        report.needs_restart.append(f"{config_path}: {', '.join(restart)} changed")
    # From the running configuration: a new policies_dir or storage waits for a restart.
    problems: list[str] = []
    policies, locations = policies_with_locations(running, problems)
    report.refused.extend(problems)
    if policies is not None and not problems:
        report.refused.extend(_region_changes(runtime, policies, locations))
    bundle = _bundle(running, report)
    try:
        certificate = read_certificate(running.identity.cert)
    except PKIError as exc:
        report.refused.append(f"identity: {exc}")
    else:
        if certificate != runtime.credential.certificate:
            report.needs_restart.append(f"identity: {running.identity.cert} was replaced")
    if not report.ok or policies is None or bundle is None:
        return PreparedReload(report)
    report.reloaded.append(f"policies ({len(policies)} regions from {running.policies_dir})")
    applied, later = describe_bundle_reload(runtime.trust(), bundle)
    report.reloaded.append(applied)
    if later is not None:
        report.needs_restart.append(later)
    return PreparedReload(report, config, policies, bundle)


def apply_reload(
    runtime: Runtime, prepared: PreparedReload, default_log_level: int
) -> ReloadReport:
    """Put a prepared reload in force (on the event loop); a refused one changes nothing."""
    if (
        not prepared.report.ok
        or prepared.config is None
        or prepared.policies is None
        or prepared.bundle is None
    ):
        return prepared.report
    runtime.policy_cell.value = prepared.policies
    runtime.trust.replace(prepared.bundle)
    prepared.report.reloaded.append(apply_log_level(prepared.config.log_level, default_log_level))
    return prepared.report


def _region_changes(
    runtime: Runtime, policies: PolicySet, locations: dict[str, Location]
) -> list[str]:
    """Why the new policies cannot replace the old ones in a running coordinator."""
    refused: list[str] = []
    old, new = set(runtime.policies), set(policies)
    if old != new:
        added = ", ".join(sorted(new - old)) or "none"
        removed = ", ".join(sorted(old - new)) or "none"
        refused.append(
            f"policies_dir: the governed regions changed (added: {added}; removed: {removed}); "
            "restart the coordinator to apply"
        )
    for name, location in runtime.locations.items():
        fresh = locations.get(name)
        if fresh is None or (fresh.jurisdiction, fresh.region) != (
            location.jurisdiction,
            location.region,
        ):
            refused.append(
                f"storage {name}: its declared owner or jurisdiction changed; "
                "restart the coordinator to apply"
            )
    return refused


def _bundle(config: CoordinatorConfig, report: ReloadReport) -> TrustBundle | None:
    try:
        bundle = load_trust_bundle(config.trust_bundle)
    except PKIError as exc:
        report.refused.append(f"trust_bundle: {exc}")
        return None
    if bundle.federation != config.federation:
        report.refused.append(
            f"trust_bundle: {config.trust_bundle} is for federation {bundle.federation!r}, "
            f"not {config.federation!r}"
        )
        return None
    return bundle
