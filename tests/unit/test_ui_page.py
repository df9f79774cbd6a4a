"""The status page's HTML: what it shows, and that nothing from outside can run in it."""

from __future__ import annotations

import base64
import hashlib
from html.parser import HTMLParser
from typing import Any

from coordinator.api.ui.history import MAX_ROUNDS, AuditDigest
from coordinator.api.ui.page import CONTENT_SECURITY_POLICY, PageFacts, render_main, render_page
from coordinator.costs.showback import JobCost
from coordinator.state.audit import (
    GENESIS_HASH,
    AuditEntry,
    AuditEvent,
    AuditVerdict,
    chained_entry,
    validated_fields,
)

NOW = 1_700_000_100.0
HOSTILE = "\"'><script>alert(1)</script><img src=x onerror=alert(2)>"


class Elements(HTMLParser):
    """Every start tag with its attributes, and the text inside each script and style."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.inline: dict[str, list[str]] = {"script": [], "style": []}
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._open = tag if tag in self.inline else None

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self.inline[self._open].append(data)

    def handle_endtag(self, tag: str) -> None:
        self._open = None


def _parse(markup: str) -> Elements:
    parser = Elements()
    parser.feed(markup)
    parser.close()
    return parser


def _digest(details: dict[str, Any], actor: str) -> AuditDigest:
    event = AuditEvent(
        actor=actor,
        action="policy.model_delta",
        verdict=AuditVerdict.DENY,
        job="llm",
        round=0,
        region="eu-west",
        details=details,
    )
    entry = chained_entry(validated_fields(event), 1, GENESIS_HASH, NOW - 5)
    digest = AuditDigest()
    digest.fold([entry])
    return digest


def _facts(**overrides: Any) -> PageFacts:
    fields: dict[str, Any] = {
        "federation": "fed",
        "viewer": "spiffe://fed/observer/tests",
        "now": NOW,
        "regions": [
            {
                "region": "eu-west",
                "jurisdiction": "EU",
                "state": "training",
                "job": "llm",
                "round": 3,
                "train_loss": 2.5,
                "updated_at": "2023-11-14T22:14:58+00:00",
                "quarantined": {},
                "agent_version": "geofed-agent/0.1.0",
            }
        ],
        "jobs": [
            {
                "job": "llm",
                "state": "running",
                "round": 3,
                "rounds": 10,
                "global_val_loss": {"round": 3, "value": 2.25},
                "val_loss_history": [{"round": r, "value": 5.0 - r} for r in range(4)],
                "error": None,
            }
        ],
        "digest": AuditDigest(),
        "audit_head": 0,
        "fp32_bytes": {"llm": 4000},
    }
    fields.update(overrides)
    return PageFacts(**fields)


def test_the_page_shows_regions_jobs_and_the_validation_curve() -> None:
    page = render_page(_facts())
    assert "eu-west" in page
    assert "geofed-agent/0.1.0" in page
    assert "training" in page
    assert "2.25" in page
    parsed = _parse(page)
    points = [a for t, a in parsed.tags if t == "circle" and "pt" in (a.get("class") or "")]
    assert len(points) == 4
    assert ("section", {"class": "job", "id": "job-llm"}) in parsed.tags
    assert "capacity" not in page  # shown only when the region view has it


def test_capacity_priority_and_team_appear_when_present() -> None:
    regions = [{"region": "eu-west", "state": "idle", "capacity": {"gpus": 8}, "in_use": 6}]
    jobs = [
        {
            "job": "llm",
            "state": "queued",
            "priority": "high",
            "team": "search",
            "queue": {"position": 2, "reason": "waits for 8 GPUs in eu-west", "since": "x"},
        }
    ]
    page = render_main(_facts(regions=regions, jobs=jobs))
    shown_all = ("capacity", "gpus=8", "in use", "priority", "high", "search", "#2: waits for 8")
    for shown in shown_all:
        assert shown in page, shown


def test_a_jobs_newest_evaluation_shows_every_metric_of_its_task() -> None:
    assert "latest evaluation" not in render_main(_facts())
    job = {
        **_facts().jobs[0],
        "evaluation": {"round": 3, "metrics": {"val_loss": 2.25, "val_perplexity": 9.4877}},
    }
    page = render_main(_facts(jobs=[job]))
    assert "latest evaluation" in page
    assert "θ_3: val_loss 2.25, val_perplexity 9.488" in page


def test_hostile_strings_are_shown_never_run() -> None:
    digest = _digest({"reason": HOSTILE, HOSTILE: HOSTILE}, actor=f"unverified {HOSTILE}")
    facts = _facts(
        federation=HOSTILE,
        viewer=HOSTILE,
        regions=[
            {
                "region": HOSTILE,
                "state": HOSTILE,
                "detail": HOSTILE,
                "quarantined": {"llm": HOSTILE},
            }
        ],
        jobs=[{"job": HOSTILE, "state": "failed", "error": HOSTILE, "round": HOSTILE}],
        digest=digest,
        audit_head=1,
    )
    page = render_page(facts)
    parsed = _parse(page)
    scripts = [t for t, _ in parsed.tags if t == "script"]
    assert scripts == ["script"]  # the page's own, and only it
    assert not [t for t, _ in parsed.tags if t == "img"]
    handlers = [(t, k) for t, attrs in parsed.tags for k in attrs if k.startswith("on")]
    assert handlers == []
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # shown as text


def test_the_policy_pins_exactly_the_inline_script_and_style() -> None:
    parsed = _parse(render_page(_facts()))
    for kind in ("script", "style"):
        (source,) = parsed.inline[kind]
        digest = base64.b64encode(hashlib.sha256(source.encode()).digest()).decode()
        assert f"{kind}-src 'sha256-{digest}'" in CONTENT_SECURITY_POLICY
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY


def test_the_audit_tail_and_chain_status() -> None:
    digest = _digest({"reason": "no rule allows it"}, actor="spiffe://fed/region/eu-west")
    page = render_main(_facts(digest=digest, audit_head=1))
    assert "chain intact" in page
    assert "entries 1 to 1 verified" in page
    assert "no rule allows it" in page
    assert "policy.model_delta" in page
    behind = render_main(_facts(digest=digest, audit_head=5001))
    assert "5000 newer entries still being read" in behind


def test_a_job_without_history_renders_empty_charts() -> None:
    jobs = [{"job": "new", "state": "running", "round": 0, "rounds": 3, "val_loss_history": []}]
    page = render_main(_facts(jobs=jobs))
    assert page.count("no data yet") == 2
    assert "no delta accepted yet" in page
    assert "Latest snapshot: none yet" in page


def test_a_regions_round_is_split_into_what_it_reported() -> None:
    from coordinator.api.ui.history import Accepted
    from coordinator.api.ui.page import _region_bars

    told = Accepted(
        at=0.0, size=1, tokens=1, train_loss=None, train_s=10.0, encode_s=1.0, upload_s=3.0
    )
    bars = _region_bars(2, "eu-west", told, 20.0)
    assert [(b.kind, b.start, b.end) for b in bars] == [
        ("other", 0.0, 6.0),
        ("train", 6.0, 16.0),
        ("comm", 16.0, 20.0),
    ]
    assert "uploaded 3.0 s" in bars[2].label
    # Trained before the round's start (a delayed overlap): no start-up bar, cut at 0 when drawn.
    early = _region_bars(2, "eu-west", told, 8.0)
    assert [b.kind for b in early] == ["train", "comm"]
    assert early[0].start == -6.0
    # An agent that reports nothing: one bar until acceptance, as before.
    silent = Accepted(at=0.0, size=1, tokens=1, train_loss=None)
    assert [(b.kind, b.end) for b in _region_bars(2, "eu-west", silent, 9.0)] == [("work", 9.0)]


MIB = 2**20


def _accepted(rounds: range, regions: tuple[str, ...], size: int) -> AuditDigest:
    """A digest of every region's accepted delta (``size`` bytes) in each of ``rounds``."""
    entries: list[AuditEntry] = []
    prev = GENESIS_HASH
    for number in rounds:
        for region in regions:
            event = AuditEvent(
                actor="spiffe://fed/coordinator/main",
                action="delta.accept",
                verdict=AuditVerdict.ALLOW,
                job="llm",
                round=number,
                region=region,
                details={"size": size, "tokens": 1, "train_loss": 1.0},
            )
            entry = chained_entry(validated_fields(event), len(entries) + 1, prev, NOW)
            entries.append(entry)
            prev = entry.hash
    digest = AuditDigest()
    digest.fold(entries)
    return digest


def _wan_line(facts: PageFacts) -> str:
    page = render_main(facts)
    start = page.index('<p class="wan">')
    return page[start : page.index("</p>", start)]


def test_the_wan_line_counts_a_whole_model_per_delta_without_fragments() -> None:
    digest = _accepted(range(2), ("eu-west", "us-east"), MIB)
    line = _wan_line(_facts(digest=digest, fp32_bytes={"llm": 4 * MIB}))
    assert line.endswith(
        "4 deltas uploaded, 4.00 MiB against 16.00 MiB as fp32: 4.00 times fewer bytes"
    )


def test_the_wan_line_counts_each_streaming_delta_as_its_rounds_fragment() -> None:
    # F = 2: even rounds carry 3 MiB of θ's 4 MiB as fp32, odd rounds the other 1 MiB.
    digest = _accepted(range(3), ("eu-west", "us-east"), MIB // 2)
    line = _wan_line(
        _facts(
            digest=digest,
            fp32_bytes={"llm": 4 * MIB},
            round_fp32_bytes={"llm": lambda r: (3 * MIB, MIB)[r % 2]},
        )
    )
    # 2 deltas of 3, 1 and 3 MiB, not 6 whole models of 4 MiB.
    assert line.endswith(
        "6 deltas uploaded, 3.00 MiB against 14.00 MiB as fp32: 4.67 times fewer bytes"
    )


def test_past_the_kept_rounds_a_streaming_wan_line_compares_the_kept_rounds_only() -> None:
    rounds = MAX_ROUNDS + 2  # the digest forgets rounds 0 and 1
    digest = _accepted(range(rounds), ("eu-west",), MIB // 4)
    line = _wan_line(
        _facts(
            digest=digest,
            fp32_bytes={"llm": 4 * MIB},
            round_fp32_bytes={"llm": lambda r: (3 * MIB, MIB)[r % 2]},
        )
    )
    kept = MAX_ROUNDS // 2 * 4 * MIB  # 500 even and 500 odd rounds of rounds 2..1001
    assert line.endswith(
        f"{rounds} deltas uploaded, {rounds / 4:.2f} MiB; rounds 2 to {rounds - 1}: "
        f"{MAX_ROUNDS} deltas, {MAX_ROUNDS / 4:.2f} MiB against {kept / MIB:.2f} MiB as fp32: "
        "8.00 times fewer bytes"
    )


def _cost(**overrides: Any) -> JobCost:
    fields: dict[str, Any] = {
        "job": "llm", "team": "nlp", "gpu_hours": 4.0, "gpu_cost": 10.0, "upload_gb": 1.0,
        "upload_cost": 1.5, "download_gb": 2.0, "download_cost": 0.5, "storage_gb_months": 1.0,
        "storage_cost": 0.25, "tokens": 2_000_000, "rounds": 3, "unpriced": (),
    }  # fmt: skip
    fields.update(overrides)
    return JobCost(**fields)


def test_a_jobs_cost_so_far_is_shown_with_what_went_unpriced() -> None:
    page = render_main(_facts(costs={"llm": _cost()}, currency="EUR"))
    assert (
        "Cost so far: 12.25 EUR (GPU 10.00, WAN 2.00, storage 0.25), 6.12 EUR per million tokens"
    ) in page
    page = render_main(
        _facts(costs={"llm": _cost(unpriced=("WAN from ap-south",))}, currency="EUR")
    )
    assert "Cost so far: &gt;= 12.25 EUR (GPU 10.00" in page
    assert "per million tokens" not in page
    assert "not priced: WAN from ap-south" in page
    assert "Cost so far" not in render_main(_facts())  # no price table: no line


def test_a_regions_hardware_is_shown_and_trouble_stands_out() -> None:
    fine = {"host": "gpu-node-1", "gpus": 8, "gpu_utilization": 0.92, "max_temperature_c": 71.0}
    erring = {"host": "gpu-node-2", "gpus": 8, "ecc_uncorrected": 2}
    regions = [
        {"region": "eu-west", "state": "training", "hardware": fine},
        {"region": "us-east", "state": "training", "hardware": erring},
        {"region": "ap-south", "state": "idle"},
    ]
    page = render_main(_facts(regions=regions))
    assert '<span class="hardware">gpu-node-1: 8 GPUs 92% busy, hottest 71 °C</span>' in page
    assert '<span class="bad">gpu-node-2: 8 GPUs, 2 uncorrectable ECC errors</span>' in page
    assert "hardware" not in render_main(_facts())  # no region reports it: no column
