"""The state-store benchmark runs end to end in its smoke mode on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import state_store

pytestmark = pytest.mark.integration


def test_state_store_smoke_measures_every_store(tmp_path: Path) -> None:
    out = tmp_path / "state_store.json"
    assert state_store.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "state_store"
    assert report["machine"]["git"]["commit"]
    (cells,) = report["results"].values()
    assert set(cells) == set(state_store.STORES)
    for kind, cell in cells.items():
        assert len(cell["round_s"]) == 2, kind
        assert 0 < cell["publish_s_median"] < cell["round_s_median"], kind
        # 2 regions x (open, 1 chunk commit, policy audit, accept) + the publication.
        assert cell["transactions_per_round"] == 9, kind
    markdown = out.with_suffix(".md").read_text()
    assert markdown.startswith("# State store")
    for kind in state_store.STORES:
        assert f"| 2 | {kind} |" in markdown
