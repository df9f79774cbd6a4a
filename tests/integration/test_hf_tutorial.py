"""docs/tutorial-hf.md runs as written: its preparing script, the agents' dataset
sections, the job, the operator's commands against real daemons, and the loading script.

Only the tutorial's root directory (/srv/geofed-tutorial) is moved to a temporary one.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.federation import operator_cli, running_federation

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DOC = Path(__file__).resolve().parents[2] / "docs" / "tutorial-hf.md"
ROOT = "/srv/geofed-tutorial"
REGIONS = ("eu-west", "us-east")


def blocks(root: Path) -> dict[str, str]:
    """The tutorial's marked blocks by name, its root moved to ``root``."""
    text = DOC.read_text().replace(ROOT, str(root))
    found = dict(re.findall(r"<!-- tutorial: ([\w-]+) -->\n```\w+\n(.*?)```", text, re.DOTALL))
    assert set(found) == {"prepare", "agent-eu-west", "agent-us-east", "job", "run", "load"}
    return found


def run_python(source: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", source],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_the_hugging_face_tutorial_runs_as_written(tmp_path: Path) -> None:
    root = tmp_path / "tutorial"
    steps = blocks(root)
    await asyncio.to_thread(run_python, steps["prepare"], tmp_path)
    (root / "job-hf.yaml").write_text(steps["job"])

    def configure(name: str, data: dict[str, Any]) -> None:
        region = name.removeprefix("agent-")
        if region in REGIONS:
            data.update(yaml.safe_load(steps[name]))
            data["workers"]["count"] = 1

    commands = [
        shlex.split(line) for line in steps["run"].splitlines() if line.startswith("geofed ")
    ]
    assert [c[1:3] for c in commands] == [
        ["job", "submit"],
        ["job", "status"],
        ["export", "hf-tutorial"],
    ]
    submit, status, export = commands
    async with running_federation(tmp_path / "fed", regions=REGIONS, customize=configure) as fed:
        await fed.wait_ready()
        submitted = await operator_cli(fed, *submit[1:])
        assert submitted.returncode == 0, submitted.stderr
        assert "job hf-tutorial admitted" in submitted.stdout
        final = await fed.wait_for(
            lambda s: s.get("state") == "completed",
            timeout_s=240,
            what="the tutorial's job to complete",
            job="hf-tutorial",
        )
        shown = await operator_cli(fed, *status[1:])
        assert shown.returncode == 0, shown.stderr
        assert "completed" in shown.stdout
        exported = await operator_cli(fed, *export[1:])
        assert exported.returncode == 0, exported.stderr
        assert "transformers loads it with no missing or unexpected key" in exported.stdout

    assert final["round"] == 4
    history = [e["value"] for e in final["val_loss_history"]]
    assert history[-1] < history[0], history
    printed = await asyncio.to_thread(run_python, steps["load"], tmp_path)
    # The logits of one prompt over the tokenizer's 512 tokens.
    assert re.fullmatch(r"torch\.Size\(\[1, \d+, 512\]\)", printed.strip()), printed
    provenance = json.loads((root / "export" / "geofed_export.json").read_text())
    assert provenance["job"] == "hf-tutorial"
