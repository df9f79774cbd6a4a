"""The agent daemon's entry point: load the configuration, run the agent, stop on SIGTERM.

Exit codes (systemd's ``Restart=on-failure`` and ``RestartPreventExitStatus=2`` rely on
them):

- ``0``: stopped cleanly (SIGTERM or SIGINT, or a ``drain`` command finished);
- ``1``: runtime failure (the worker group failed past its relaunch cap, the broker
  refused a subscription, an unexpected error); restarting may help;
- ``2``: configuration error (the config file, the policy file, or the identity files it
  names); restarting will not help until the files are fixed.

On SIGTERM the agent cancels the round in progress (its durable state lets the next
start resume it), stops the worker group (a stop request, then SIGKILL after its
deadline), publishes ``offline`` and exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

from policies import PolicyLoadError, PolicySet
from regional_agent.agent import Agent, AgentFailed
from regional_agent.config import (
    AgentConfig,
    AgentConfigError,
    load_config,
    load_region_policies,
)
from regional_agent.credentials import Credentials, CredentialsError, load_credentials

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2


def main(config_path: Path | str) -> int:
    """Run the agent configured by ``config_path``; return the process exit code."""
    try:
        config = load_config(config_path)
        credentials = load_credentials(config)
        policies = load_region_policies(config)
    except AgentConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    except (CredentialsError, PolicyLoadError) as exc:
        print(f"error: {config_path}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        asyncio.run(serve(config, credentials, policies))
    except AgentFailed as exc:
        log.error("agent failed: %s", exc)  # noqa: TRY400 - the reason is the message
        return EXIT_FAILURE
    except Exception:
        log.exception("agent failed")
        return EXIT_FAILURE
    log.info("agent stopped")
    return EXIT_OK


async def serve(config: AgentConfig, credentials: Credentials, policies: PolicySet) -> None:
    """Run an agent in this event loop until SIGTERM/SIGINT, a drain, or a failure."""
    agent = Agent(config, credentials, policies)
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)

    def on_signal(signum: int) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        agent.request_stop()

    for signum in signals:
        loop.add_signal_handler(signum, on_signal, signum)
    log.info(
        "agent for region %s of federation %s starting (state in %s)",
        config.region,
        config.federation,
        config.state_dir,
    )
    try:
        await agent.run()
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
