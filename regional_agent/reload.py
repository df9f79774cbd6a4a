"""The agent's reload (SIGHUP): the region's policy, trust bundle and log level, or nothing.

:func:`prepare_reload` (blocking: run it in a thread) reads the configuration file again
with every check of start-up (the policy file loads and governs this region, the datasets
are declared, the credential is this region's), then the trust bundle in force. If
anything is unusable the reload is refused and nothing changes. :func:`apply_reload` swaps
them in: the export gate asks the new policy before the next round trains or uploads, and
the coordinator's next update is verified against the new revocations.

``policy``, ``datasets`` and ``log_level`` change in a running agent; any other changed
key, and a replaced identity certificate, need a restart: the reload says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from geofed.pki import PKIError, TrustBundle, load_trust_bundle, read_certificate
from geofed.pki.bundle_source import ReloadingBundle, current
from geofed.reload import ReloadReport, apply_log_level, changed_keys, describe_bundle_reload
from policies import PolicyLoadError, PolicySet
from regional_agent.agent import Agent
from regional_agent.config import (
    AgentConfig,
    AgentConfigError,
    dataset_locations,
    load_config,
    load_region_policies,
    training_datasets,
)
from regional_agent.credentials import Credentials

__all__ = ["RELOADABLE_KEYS", "PreparedAgentReload", "apply_reload", "prepare_reload"]

#: Keys of the agent's file a reload applies; any other change needs a restart.
RELOADABLE_KEYS = frozenset({"policy", "datasets", "log_level"})


@dataclass(frozen=True)
class PreparedAgentReload:
    """What a reload read and checked; ``report.ok`` says whether it may be applied."""

    report: ReloadReport
    config: AgentConfig | None = None
    policies: PolicySet | None = None
    datasets: tuple[str, ...] = ()
    bundle: TrustBundle | None = None


def prepare_reload(
    running: AgentConfig, credentials: Credentials, config_path: Path | str
) -> PreparedAgentReload:
    """Read and check everything a reload would apply; nothing running changes."""
    report = ReloadReport()
    try:
        config = load_config(config_path)
    except AgentConfigError as exc:
        report.refused.extend(str(problem) for problem in exc.problems)
        return PreparedAgentReload(report)
    restart = changed_keys(running, config, ignore=RELOADABLE_KEYS)
    if restart:
        report.needs_restart.append(f"{config_path}: {', '.join(restart)} changed")
    try:
        policies = load_region_policies(config)
    except PolicyLoadError as exc:
        report.refused.extend(f"policy: {problem}" for problem in exc.problems)
        return PreparedAgentReload(report)
    datasets = training_datasets(config, policies)
    bundle_file = running.identity.trust_bundle
    try:
        bundle = load_trust_bundle(bundle_file)
    except PKIError as exc:
        report.refused.append(f"identity.trust_bundle: {exc}")
        return PreparedAgentReload(report)
    if bundle.federation != running.federation:
        report.refused.append(
            f"identity.trust_bundle: {bundle_file} is for federation {bundle.federation!r}, "
            f"not {running.federation!r}"
        )
        return PreparedAgentReload(report)
    try:
        if read_certificate(running.identity.cert) != credentials.certificate:
            report.needs_restart.append(f"identity: {running.identity.cert} was replaced")
    except PKIError as exc:
        report.needs_restart.append(f"identity: {exc}")
    report.reloaded.append(f"policy {config.policy} (datasets: {', '.join(datasets) or 'none'})")
    applied, later = describe_bundle_reload(current(credentials.trust), bundle)
    report.reloaded.append(applied)
    if later is not None:
        report.needs_restart.append(later)
    return PreparedAgentReload(report, config, policies, datasets, bundle)


def apply_reload(
    agent: Agent, credentials: Credentials, prepared: PreparedAgentReload, default_log_level: int
) -> ReloadReport:
    """Put a prepared reload in force (on the event loop); a refused one changes nothing."""
    if (
        not prepared.report.ok
        or prepared.config is None
        or prepared.policies is None
        or prepared.bundle is None
    ):
        return prepared.report
    agent.use_policies(prepared.policies, prepared.datasets, dataset_locations(prepared.config))
    if isinstance(credentials.reloading, ReloadingBundle):
        credentials.reloading.replace(prepared.bundle)
    prepared.report.reloaded.append(apply_log_level(prepared.config.log_level, default_log_level))
    return prepared.report
