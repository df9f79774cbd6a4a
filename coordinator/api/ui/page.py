"""The status page's HTML: a pure function of what the coordinator knows.

:func:`render_main` renders the live part (what the page's script fetches again every
few seconds), :func:`render_page` wraps it in the document with its style and script.
The document allows no script or style but those two (``CONTENT_SECURITY_POLICY``,
pinned by hash), and every value from outside goes through :func:`text`, so a hostile
region name or audit detail is shown, never run.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html import escape
from typing import Any, Final

from pydantic import ValidationError

from coordinator.api.ui.history import Accepted, AuditDigest, JobHistory
from coordinator.api.ui.svg import Bar, Series, bar_rows, line_chart, nice_number
from coordinator.costs.showback import JobCost
from coordinator.state.audit import AuditEntry, entry_time
from geofed.control import HardwareSummary

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "SCRIPT",
    "STYLE",
    "PageFacts",
    "render_main",
    "render_page",
    "text",
]

#: Rounds drawn in the per-round timeline (the newest).
TIMELINE_ROUNDS: Final = 8

STYLE: Final = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#243447;color:#fff;padding:8px 16px}
header b{font-weight:600}
main{padding:8px 16px}
section{background:#fff;border:1px solid #ddd;border-radius:4px;margin:12px 0;padding:8px 12px}
h2{font-size:16px;margin:4px 0 8px}
h3{font-size:14px;margin:10px 0 4px}
table{border-collapse:collapse;font-size:13px}
th,td{text-align:left;padding:2px 8px;border-bottom:1px solid #eee;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#2a7d2a}.bad{color:#b00020;font-weight:600}.muted{color:#777}
.charts{display:flex;flex-wrap:wrap;gap:12px}
svg text{font-size:11px;fill:#333}
code{font-size:12px}
#refresh{float:right;font-size:12px;color:#cde}
""".strip()

# Fetches the live part again every data-refresh seconds (paused while the tab is
# hidden); a failed fetch is shown in the header, not thrown.
SCRIPT: Final = """
(function(){
const main=document.getElementById('live');
const note=document.getElementById('refresh');
const every=Math.max(1,parseInt(main.dataset.refresh||'5',10))*1000;
async function tick(){
 if(document.hidden){return;}
 try{
  const r=await fetch(location.pathname+'?part=main',{cache:'no-store',credentials:'same-origin'});
  if(!r.ok){note.textContent='refresh failed: HTTP '+r.status;return;}
  main.innerHTML=await r.text();
  note.textContent='updated '+new Date().toLocaleTimeString();
 }catch(e){note.textContent='refresh failed: '+e.message;}
}
setInterval(tick,every);
})();
""".strip()


def _sha256_source(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


#: Only the page's own inline script and style run; fetches go to this origin only.
CONTENT_SECURITY_POLICY: Final = "; ".join(
    [
        "default-src 'none'",
        f"script-src {_sha256_source(SCRIPT)}",
        f"style-src {_sha256_source(STYLE)}",
        "img-src data:",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)


def text(value: Any) -> str:
    """Any value as escaped HTML text (None as a dash)."""
    if value is None:
        return "&ndash;"
    if isinstance(value, float):
        return nice_number(value)
    if isinstance(value, Mapping):
        return escape(", ".join(f"{k}={_plain(v)}" for k, v in value.items()))
    if isinstance(value, list | tuple):
        return escape(", ".join(_plain(v) for v in value))
    return escape(str(value))


def _plain(value: Any) -> str:
    if isinstance(value, Mapping | list | tuple):
        return json.dumps(value, sort_keys=True, default=str)
    return nice_number(value) if isinstance(value, float) else str(value)


@dataclass(frozen=True, slots=True)
class PageFacts:
    """Everything the page shows, gathered by the handler.

    ``regions`` and ``jobs`` are the bodies of ``GET /v1/regions`` and ``GET /v1/jobs``
    (whatever fields they carry); ``fp32_bytes`` is a job's model size as fp32 (every
    round's delta size unless the job streams); ``round_fp32_bytes`` maps a streaming
    job's round r to its delta size as fp32 (the round's fragment); ``audit_head`` the
    newest seq in the log (the digest may still be catching up).
    """

    federation: str
    viewer: str
    now: float
    regions: Sequence[Mapping[str, Any]]
    jobs: Sequence[Mapping[str, Any]]
    digest: AuditDigest
    audit_head: int
    fp32_bytes: Mapping[str, int] = field(default_factory=dict)
    refresh_s: int = 5
    round_fp32_bytes: Mapping[str, Callable[[int], int]] = field(default_factory=dict)
    #: Each job's cost since it started (:mod:`coordinator.costs`), when prices are set.
    costs: Mapping[str, JobCost] = field(default_factory=dict)
    currency: str = ""


def render_page(facts: PageFacts) -> str:
    """The whole document."""
    title = f"geofed · {facts.federation}"
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f'<title>{escape(title)}</title><link rel="icon" href="data:,">'
        f"<style>{STYLE}</style></head><body>"
        f'<header><span id="refresh"></span>geofed federation <b>{escape(facts.federation)}</b>'
        f" · viewing as {escape(facts.viewer)}</header>"
        f'<main id="live" data-refresh="{int(facts.refresh_s)}">{render_main(facts)}</main>'
        f"<script>{SCRIPT}</script></body></html>"
    )


def render_main(facts: PageFacts) -> str:
    """The live part: federation, jobs, each job's detail, the audit tail."""
    parts = [
        f'<p class="muted">as of {escape(_iso(facts.now))}</p>',
        _regions_section(facts),
        _jobs_section(facts),
    ]
    for job in facts.jobs:
        name = str(job.get("job", ""))
        history = facts.digest.jobs.get(name) or JobHistory(name)
        cost = _cost(facts.costs.get(name), facts.currency)
        fp32, round_fp32 = facts.fp32_bytes.get(name), facts.round_fp32_bytes.get(name)
        parts.append(_job_detail(job, history, fp32, round_fp32, cost))
    parts.append(_audit_section(facts))
    return "".join(parts)


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


def _ago(iso: Any, now: float) -> str:
    if not isinstance(iso, str):
        return "never"
    try:
        seen = datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return text(iso)
    return f"{text(iso)} <span class='muted'>({max(now - seen, 0):.0f} s ago)</span>"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], css_id: str) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table id="{css_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _regions_section(facts: PageFacts) -> str:
    with_capacity = any("capacity" in r or "in_use" in r for r in facts.regions)
    with_hardware = any(r.get("hardware") for r in facts.regions)
    headers = ["region", "jurisdiction", "state", "job · round", "train loss", "last seen"]
    headers += ["capacity", "in use"] if with_capacity else []
    headers += ["hardware"] if with_hardware else []
    headers += ["quarantine", "agent version", "detail"]
    rows = []
    for region in facts.regions:
        state = str(region.get("state", "unknown"))
        css = "ok" if state not in ("offline", "error", "unknown") else "bad"
        quarantined = region.get("quarantined") or {}
        row = [
            f'<span class="region-name">{text(region.get("region"))}</span>',
            text(region.get("jurisdiction")),
            f'<span class="state {css}">{text(state)}</span>',
            f"{text(region.get('job'))} · {text(region.get('round'))}",
            text(region.get("train_loss")),
            _ago(region.get("updated_at"), facts.now),
        ]
        if with_capacity:
            row += [text(region.get("capacity")), text(region.get("in_use"))]
        if with_hardware:
            row.append(_hardware(region.get("hardware")))
        row += [
            f'<span class="bad">{text(quarantined)}</span>' if quarantined else "no",
            text(region.get("agent_version")),
            text(region.get("detail")),
        ]
        rows.append(row)
    return (
        f'<section id="federation"><h2>Federation · {len(facts.regions)} regions</h2>'
        f"{_table(headers, rows, 'regions')}</section>"
    )


def _hardware(summary: Any) -> str:
    """A region's node as its status reported it; slowed or erring GPUs stand out."""
    if not isinstance(summary, Mapping):
        return text(None)
    try:
        hardware = HardwareSummary.model_validate(summary)
    except ValidationError:
        return text(None)
    trouble = (
        hardware.slowed_gpus,
        hardware.ecc_uncorrected,
        hardware.ecc_uncorrected_new,
        hardware.xid_errors_recent,
    )
    css = "bad" if any(trouble) else "hardware"
    return f'<span class="{css}">{text(hardware.describe())}</span>'


_JOB_EXTRAS: Final = (
    ("priority", ("priority",)),
    ("team", ("team", "owner_team")),
    ("queue", ("queue", "queue_position")),
)


def _job_field(job: Mapping[str, Any], keys: Sequence[str]) -> Any:
    raw = job.get("spec")
    spec: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    for key in keys:
        if key in job:
            return job[key]
        if key in spec:
            return spec[key]
    return None


def _evaluation(value: Any) -> str:
    """A job's newest evaluation as "θ_N: name value, ..." (every metric its task gave)."""
    if not isinstance(value, Mapping) or not isinstance(value.get("metrics"), Mapping):
        return text(None)
    metrics = ", ".join(
        f"{name} {float(number):.4g}"
        for name, number in sorted(value["metrics"].items())
        if _finite(number)
    )
    return text(f"θ_{value.get('round')}: {metrics}")


def _extra(value: Any) -> str:
    """A scheduling field; a queue place (``{"position", "reason", ...}``) as "#N: why"."""
    if isinstance(value, Mapping) and "position" in value:
        return f"#{text(value.get('position'))}: {text(value.get('reason'))}"
    return text(value)


def _jobs_section(facts: PageFacts) -> str:
    extras = [
        (label, keys)
        for label, keys in _JOB_EXTRAS
        if any(_job_field(job, keys) is not None for job in facts.jobs)
    ]
    evaluated = any(isinstance(job.get("evaluation"), Mapping) for job in facts.jobs)
    headers = ["job", "state", "round", "global val loss", *(label for label, _ in extras)]
    if evaluated:
        headers.append("latest evaluation")
    headers.append("error")
    rows = []
    for job in facts.jobs:
        loss = job.get("global_val_loss")
        value = loss.get("value") if isinstance(loss, Mapping) else None
        state = str(job.get("state", ""))
        css = "bad" if state in ("failed", "unavailable") else "ok"
        rows.append(
            [
                f'<a href="#job-{escape(str(job.get("job", "")))}">{text(job.get("job"))}</a>',
                f'<span class="{css}">{text(state)}</span>',
                f"{text(job.get('round'))} / {text(job.get('rounds'))}",
                text(value),
                *(_extra(_job_field(job, keys)) for _, keys in extras),
                *([_evaluation(job.get("evaluation"))] if evaluated else []),
                text(job.get("error")),
            ]
        )
    return f'<section id="jobs"><h2>Jobs</h2>{_table(headers, rows, "jobs-table")}</section>'


_EVENTS_TITLE: Final = "Job events (admission, refusals, failures, exports, pruning)"


def _job_detail(
    job: Mapping[str, Any],
    history: JobHistory,
    fp32_bytes: int | None,
    round_fp32_bytes: Callable[[int], int] | None,
    cost: str = "",
) -> str:
    name = str(job.get("job", ""))
    val_points = [
        (float(e["round"]), float(e["value"]))
        for e in job.get("val_loss_history") or []
        if isinstance(e, Mapping) and _finite(e.get("round")) and _finite(e.get("value"))
    ]
    val_chart = line_chart(
        [Series("global validation loss", val_points)],
        title=f"{name}: global validation loss",
        css_class="chart val-loss",
    )
    regions = history.regions()
    train_series = [
        Series(
            region,
            [
                (float(number), _or_nan(facts.accepted[region].train_loss))
                for number, facts in sorted(history.rounds.items())
                if region in facts.accepted
            ],
        )
        for region in regions
    ]
    train_chart = line_chart(
        train_series, title=f"{name}: training loss by region", css_class="chart train-loss"
    )
    return (
        f'<section class="job" id="job-{escape(name)}"><h2>Job {text(name)}</h2>'
        f'<div class="charts">{val_chart}{train_chart}</div>'
        f"{_wan(history, fp32_bytes, round_fp32_bytes)}{cost}{_timeline(history)}"
        f"{_snapshot(history)}"
        f"{_events('Recent policy decisions', history.policy, 'policy')}"
        f"{_events(_EVENTS_TITLE, history.events, 'events')}"
        "</section>"
    )


def _cost(cost: JobCost | None, currency: str) -> str:
    """A job's cost so far: what was priced, split, and per million tokens."""
    if cost is None:
        return ""
    floor = ">= " if cost.unpriced else ""
    line = (
        f"{floor}{cost.total:,.2f} {currency} (GPU {cost.gpu_cost:,.2f}, WAN "
        f"{cost.upload_cost + cost.download_cost:,.2f}, storage {cost.storage_cost:,.2f})"
    )
    if cost.per_million_tokens is not None:
        line += f", {cost.per_million_tokens:,.2f} {currency} per million tokens"
    if cost.unpriced:
        line += f"; not priced: {', '.join(cost.unpriced)}"
    return f'<p class="cost">Cost so far: {escape(line)}</p>'


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _mib(size: float) -> str:
    return f"{size / 2**20:.2f} MiB"


def _wan(
    history: JobHistory, fp32_bytes: int | None, round_fp32_bytes: Callable[[int], int] | None
) -> str:
    if not history.deltas:
        return '<p class="wan muted">WAN: no delta accepted yet.</p>'
    line = f"{history.deltas} deltas uploaded, {_mib(history.uploaded_bytes)}"
    if round_fp32_bytes is not None:
        line += _rounds_against_fp32(history, round_fp32_bytes)
    elif fp32_bytes:
        line += _against_fp32(fp32_bytes * history.deltas, history.uploaded_bytes)
    return f'<p class="wan">WAN (regions to coordinator): {escape(line)}</p>'


def _rounds_against_fp32(history: JobHistory, round_fp32_bytes: Callable[[int], int]) -> str:
    """The fp32 comparison when rounds differ in size (a streaming job's fragments).

    Each delta counts its own round's size, so only the rounds the digest keeps can be
    summed: over all of them when they hold every accepted delta, else over those rounds.
    """
    kept = [(number, facts.accepted) for number, facts in history.rounds.items()]
    deltas = sum(len(accepted) for _, accepted in kept)
    fp32 = sum(len(accepted) * round_fp32_bytes(number) for number, accepted in kept)
    if deltas == history.deltas:
        return _against_fp32(fp32, history.uploaded_bytes)
    if not deltas:
        return ""
    uploaded = sum(a.size for _, accepted in kept for a in accepted.values())
    first, last = min(history.rounds), max(history.rounds)
    return (
        f"; rounds {first} to {last}: {deltas} deltas, {_mib(uploaded)}"
        f"{_against_fp32(fp32, uploaded)}"
    )


def _against_fp32(fp32: int, uploaded: int) -> str:
    if not fp32:
        return ""
    ratio = fp32 / uploaded if uploaded else math.inf
    return f" against {_mib(fp32)} as fp32: {ratio:.2f} times fewer bytes"


def _region_bars(number: int, region: str, accepted: Accepted, done: float) -> list[Bar]:
    """One region's round, placed back from its acceptance at ``done`` s after the start."""
    where = f"round {number} {region}"
    if accepted.train_s is None:
        label = f"{where}: delta in after {done:.1f} s"
        if done < 0:  # overlap: sent before the previous round was published
            label = f"{where}: delta in {-done:.1f} s before the round's start"
        return [Bar(0.0, max(done, 0.0), "work", label)]
    upload, encode = accepted.upload_s or 0.0, accepted.encode_s or 0.0
    comm_start = done - upload - encode
    train_start = comm_start - accepted.train_s
    bars = []
    if train_start > 0:
        bars.append(Bar(0.0, train_start, "other", f"{where}: download, apply, start-up"))
    bars.append(Bar(train_start, comm_start, "train", f"{where}: trained {accepted.train_s:.1f} s"))
    bars.append(
        Bar(comm_start, done, "comm", f"{where}: encoded {encode:.1f} s, uploaded {upload:.1f} s")
    )
    return bars


def _timeline(history: JobHistory) -> str:
    numbers = sorted(history.rounds)[-TIMELINE_ROUNDS:]
    rows: list[tuple[str, list[Bar]]] = []
    for number in numbers:
        facts = history.rounds[number]
        start = history.round_start(number)
        if start is None or not math.isfinite(start):
            continue
        for region in sorted(facts.accepted):
            accepted = facts.accepted[region]
            done = accepted.at - start
            bars = _region_bars(number, region, accepted, done)
            if facts.published_at is not None:
                end = facts.published_at - start
                bars.append(Bar(done, end, "wait", f"waited {end - done:.1f} s for publication"))
            rows.append((f"r{number} {region}", bars))
    if not rows:
        return '<p class="muted">Round timeline: no round has a known start yet.</p>'
    chart = bar_rows(rows, title="per-round timeline")
    return (
        "<h3>Per-round timeline</h3>"
        '<p class="muted">From the round\'s start (the previous publication), per region as its '
        "agent reported them: light: download, apply and start-up; green: training; orange: "
        "encoding and upload, until the delta was accepted; grey: waiting for the round's "
        "publication. A bar starting before 0 (a delayed overlap) is cut at 0; a region that "
        f"reports no timings shows one blue bar until acceptance.</p>{chart}"
    )


def _snapshot(history: JobHistory) -> str:
    snap = history.snapshot
    if snap is None:
        return '<p class="snapshot muted">Latest snapshot: none yet.</p>'
    return (
        f'<p class="snapshot">Latest snapshot: θ_{snap.version}, <code>{text(snap.digest[:16])}'
        f"</code>…, at {escape(_iso(snap.at) if math.isfinite(snap.at) else '?')}</p>"
    )


def _entry_row(entry: AuditEntry) -> list[str]:
    verdict_css = "bad" if entry.verdict in ("deny", "error") else "ok"
    return [
        text(entry.seq),
        text(entry.time),
        text(entry.actor),
        text(entry.action),
        f'<span class="{verdict_css}">{text(entry.verdict)}</span>',
        text(entry.job),
        text(entry.round),
        text(entry.region),
        f"<code>{_details(entry.details)}</code>",
    ]


def _details(details: Mapping[str, Any]) -> str:
    summary = details.get("reason") if isinstance(details.get("reason"), str) else None
    raw = summary or json.dumps(details, sort_keys=True, default=str)
    return escape(raw if len(raw) <= 240 else raw[:239] + "…")


_ENTRY_HEADERS: Final = (
    "seq",
    "time",
    "actor",
    "action",
    "verdict",
    "job",
    "round",
    "region",
    "details",
)


def _events(title: str, entries: Sequence[AuditEntry], css: str) -> str:
    if not entries:
        return f'<p class="{css} muted">{escape(title)}: none.</p>'
    rows = [_entry_row(entry) for entry in reversed(entries)]
    return f"<h3>{escape(title)}</h3>{_table(_ENTRY_HEADERS, rows, css)}"


def _audit_section(facts: PageFacts) -> str:
    chain = facts.digest.chain
    if chain.ok:
        status = (
            '<span class="ok chain-ok">chain intact</span>: '
            f"entries 1 to {chain.checked} verified, "
            f"head <code>{text(chain.head_hash[:16])}</code>…"
        )
    else:
        status = (
            f'<span class="bad chain-broken">chain BROKEN at entry '
            f"{text(chain.first_bad_seq)}</span>: {text(chain.reason)}"
        )
    behind = facts.audit_head - facts.digest.seq
    if behind > 0:
        status += f' <span class="muted">({behind} newer entries still being read)</span>'
    rows = [_entry_row(entry) for entry in reversed(facts.digest.tail)]
    newest = facts.digest.tail[-1] if facts.digest.tail else None
    age = ""
    if newest is not None:
        at = entry_time(newest.time)
        if math.isfinite(at):
            age = f" · newest {max(facts.now - at, 0):.0f} s ago"
    return (
        f'<section id="audit"><h2>Audit log · {facts.audit_head} entries{age}</h2>'
        f'<p id="chain">{status}</p>{_table(_ENTRY_HEADERS, rows, "audit-tail")}</section>'
    )


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value
