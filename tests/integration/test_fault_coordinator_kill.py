"""The coordinator killed with SIGKILL while it aggregates, and again while it publishes.

Two coordinator daemons (real processes, real TLS, real SQLite, Mosquitto with mutual
TLS) run the same three-round job, fed the same deltas by test code acting as two
regions (FakeRegion: fixed seeds, fixed token counts). The reference runs uninterrupted.
The other is armed with ``GEOFED_FAULT_PAUSE_AT`` (:mod:`coordinator.faults`): it is
killed once round 1 has closed and before anything of its publication is computed,
restarted, killed again once round 1's update, θ_2's snapshot and working state are
stored but the publishing transaction has not committed, and restarted for good.

What it proves: every round's published update stream and parameter hash, and the final
checkpoint chain, are bit for bit the reference's; round 1 is applied exactly once (one
``round.publish`` audit entry per round, two accepted deltas per round, the job's round
counter at 3); nothing uncommitted is served while the publication waits for its commit;
the reference folded every round's deltas as they were accepted, the restarted daemon
decoded round 1's again in the recorded arrival order, with the same bits. θ_1's working
state was never saved (it is saved with snapshots, every 2 rounds here): each restart
rebuilt it from θ_0's by replaying round 0 from its kept deltas, and once the job ended
the blob store holds the last working state alone.
And a fault point the coordinator does not know stops it with a configuration error.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from coordinator.faults import FAULT_ENV
from coordinator.storage.checkpoints import CheckpointStore
from coordinator.storage.job_blobs import JobBlobStores
from geofed.ports import unused_port
from geofed_cli import main
from tests.support.coordinator import request, write_setup
from tests.support.coordinator_daemon import (
    JOB,
    REGIONS,
    ROUNDS,
    daemon_with_broker,
    outcome,
    run_reference,
)
from tests.support.pki import make_federation

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KILLED_ROUND = 1


async def test_killed_while_aggregating_and_publishing_the_round_is_bit_identical(
    tmp_path: Path,
) -> None:
    fed = make_federation(tmp_path / "fed", "acme")
    reference = await run_reference(tmp_path / "reference", fed)

    async with daemon_with_broker(tmp_path / "killed", fed) as daemon:
        await daemon.start(fault=f"aggregate:{KILLED_ROUND}")
        await daemon.submit()
        await daemon.deliver(0)
        await daemon.wait_published(0)
        await daemon.deliver(KILLED_ROUND)

        # Killed while aggregating: the round is closed, nothing of it computed yet.
        await daemon.wait_marker("aggregate", KILLED_ROUND)
        job = await daemon.job()
        assert (job["round"], job["current"]["phase"]) == (KILLED_ROUND, "aggregating"), job
        await daemon.kill()

        # Killed while publishing: update and snapshot stored, the round not committed.
        restarted = time.monotonic()
        await daemon.start(fault=f"publish:{KILLED_ROUND}")
        await daemon.wait_marker("publish", KILLED_ROUND)
        job = await daemon.job()
        assert (job["round"], job["current"]["phase"]) == (KILLED_ROUND, "aggregating"), job
        region = daemon.region(REGIONS[0])
        path = f"/v1/jobs/{JOB}/rounds/{KILLED_ROUND}/update"
        status, body = await request(region.session, "GET", path)
        assert (status, body["error"]) == (404, "not_found"), body  # not published yet
        _, _, version = await region.download_params(JOB)
        assert version == KILLED_ROUND  # the chain served stops at the committed θ
        await daemon.kill()
        # What the killed publication left behind: round 1's update and θ_2's snapshot.
        store = CheckpointStore("eu-ckpt", daemon.setup.root / "ckpt" / "eu")
        recorded = [(e.kind.value, e.round) for e in store.entries(JOB)]
        assert ("update", KILLED_ROUND) in recorded, recorded
        assert ("snapshot", KILLED_ROUND + 1) in recorded, recorded

        last_start = time.monotonic()
        await daemon.start()
        await daemon.wait_published(KILLED_ROUND)
        recovery_s = time.monotonic() - restarted
        last_recovery_s = time.monotonic() - last_start
        for round_ in range(KILLED_ROUND + 1, ROUNDS):
            await daemon.deliver(round_)
            await daemon.wait_published(round_)
        killed = await outcome(daemon)
        entries = await daemon.audit()
        blobs = list(JobBlobStores(daemon.state_dir).for_job(JOB).iter_digests())

    # Bit for bit what the uninterrupted coordinator published, round after round.
    for round_ in range(ROUNDS):
        stream, parameters_hash = killed.updates[round_]
        ref_stream, ref_hash = reference.updates[round_]
        assert stream == ref_stream, f"round {round_}: the update stream differs"
        assert parameters_hash == ref_hash, f"round {round_}: θ_{round_ + 1} differs"
    assert killed.final_hash == reference.final_hash
    assert (killed.checkpoint_hash, killed.checkpoint_round) == (killed.final_hash, ROUNDS)
    assert (reference.checkpoint_hash, reference.checkpoint_round) == (killed.final_hash, ROUNDS)

    # Applied once: one publication per round, each delta accepted once.
    published = [e.round for e in entries if e.action == "round.publish"]
    assert published == list(range(ROUNDS)), published
    accepted = sorted((e.round, e.region) for e in entries if e.action == "delta.accept")
    assert accepted == [(r, name) for r in range(ROUNDS) for name in REGIONS], accepted
    hashes = [e.details["params_hash"] for e in entries if e.action == "round.publish"]
    assert hashes == [reference.updates[r][1] for r in range(ROUNDS)]
    # The uninterrupted rounds summed their deltas as they were accepted; the restarted
    # coordinator decoded the killed round's deltas again, in the recorded arrival
    # order, and published the same bits as the reference, which had folded them.
    summation = {e.round: e.details["summation"] for e in entries if e.action == "round.publish"}
    assert summation == {
        r: "decoded at publication" if r == KILLED_ROUND else "folded on arrival"
        for r in range(ROUNDS)
    }, summation
    # θ_3, its outer state and residual: no delta kept for a replay, no older state.
    assert len(blobs) == 3, blobs
    print(
        f"\ncoordinator killed at aggregate and at publish of round {KILLED_ROUND}: "
        f"θ_{KILLED_ROUND + 1} published {recovery_s:.1f} s after the first restart (two "
        f"process starts), {last_recovery_s:.1f} s after the last one; no delta was re-sent"
    )


def test_an_unknown_fault_point_is_a_configuration_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    setup = write_setup(tmp_path, unused_port())
    monkeypatch.setenv(FAULT_ENV, "aggregating")
    assert main(["coordinator", "--config", str(setup.config_path)]) == 2
    err = capsys.readouterr().err
    assert f"{FAULT_ENV}='aggregating': the phase must be one of aggregate, publish" in err
    monkeypatch.setenv(FAULT_ENV, "publish:last")
    assert main(["coordinator", "--config", str(setup.config_path)]) == 2
    assert "the round must be an integer >= 0" in capsys.readouterr().err
