"""The demo's WAN routing and its utilization figures, without processes or sockets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from geofed_cli.demo.utilization import format_utilization, utilization_by_region
from geofed_cli.demo.wan import route_configs
from regional_agent.rounds.timeline import FILE_NAME, Interval, RoundTimeline


def test_agents_go_through_their_own_link_and_the_job_gets_the_overlap_mode() -> None:
    customize = route_configs({"eu-west": 4100, "us-east": 4200}, overlap="delayed")
    docs: dict[str, dict[str, Any]] = {
        "agent-eu-west": {"coordinator_url": "https://localhost:8443"},
        "agent-us-east": {"coordinator_url": "https://localhost:8443"},
        "coordinator": {"listen": {"port": 8443}},
        "job": {"rounds": 2},
    }
    for name, data in docs.items():
        customize(name, data)
    assert docs["agent-eu-west"]["coordinator_url"] == "https://localhost:4100"
    assert docs["agent-us-east"]["coordinator_url"] == "https://localhost:4200"
    assert docs["coordinator"] == {"listen": {"port": 8443}}
    assert docs["job"] == {"rounds": 2, "overlap": "delayed"}


def test_without_a_wan_or_overlap_nothing_changes() -> None:
    customize = route_configs({}, overlap=None)
    agent = {"coordinator_url": "https://localhost:8443"}
    job = {"rounds": 2}
    customize("agent-eu-west", agent)
    customize("job", job)
    assert agent == {"coordinator_url": "https://localhost:8443"}
    assert job == {"rounds": 2}


def _write(state_dir: Path, *rounds: RoundTimeline) -> None:
    state_dir.mkdir(parents=True)
    lines = [json.dumps(r.to_json()) + "\n" for r in rounds]
    (state_dir / FILE_NAME).write_text("".join(lines))


def test_utilization_per_region_from_the_agents_timelines(tmp_path: Path) -> None:
    def trained(job: str, round_: int, start: float, end: float) -> RoundTimeline:
        return RoundTimeline(job, round_, {}, Interval(start, end, end - start))

    _write(tmp_path / "eu-west", trained("demo", 0, 0, 8), trained("demo", 1, 10, 18))
    # Another job's rounds in the same state directory do not count.
    _write(tmp_path / "us-east", trained("demo", 0, 0, 5), trained("other", 0, 100, 200))
    (tmp_path / "ap-south").mkdir()
    found = utilization_by_region(tmp_path, ["eu-west", "us-east", "ap-south"], "demo")
    assert found == {"eu-west": 16 / 18, "us-east": 1.0, "ap-south": None}
    assert format_utilization(found) == "0.89 1.00 -"
    (tmp_path / "eu-west" / FILE_NAME).write_text('{"job": 1}\n')
    assert utilization_by_region(tmp_path, ["eu-west"], "demo") == {"eu-west": None}
