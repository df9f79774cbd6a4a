"""A job's rounds over real TLS, a real SQLite state directory and an embedded broker."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from coordinator.publication.evaluation import (
    VAL_HISTORY_POINTER,
    VAL_LOSS_POINTER,
    format_history,
    format_val_loss,
)
from coordinator.state.audit import AuditEntry, verify_chain
from geofed.control.broker import EmbeddedBroker
from geofed.params import parameters_vector_hash
from tests.support.coordinator import (
    Announcements,
    coordinator,
    job_yaml,
    metric_value,
    request,
    write_setup,
)

pytestmark = pytest.mark.integration


async def test_a_round_runs_from_submission_to_a_verifiable_update(tmp_path: Path) -> None:
    async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            task = "tests.support.coordinator:EvaluatedTinyTask"
            # Evaluated by the coordinator, in its evaluation process: θ_0 and θ_1 here.
            spec = job_yaml(task=task, extra="evaluation: {where: coordinator}\n")
            status, body = await request(operator, "POST", "/v1/jobs", data=spec)
            assert status == 201, body
            assert body["checkpoint_location"] == "eu-ckpt"  # eu-west keeps models in the EU

            first = await announcements.until(round=0, state="open")
            assert first.participants == ("eu-west", "us-east")
            assert first.update_url is None

            eu, us = running.region("eu-west"), running.region("us-east")
            theta0, theta0_hash, version = await us.download_params("tiny")
            assert (version, theta0_hash) == (0, first.base_hash)

            manifest, stream = eu.delta("tiny", 0, first.base_hash, seed=1, tokens=100)
            status, body = await eu.three_step("tiny", 0, manifest, stream)
            assert (status, body["state"]) == (200, "accepted"), body
            # Idempotent: the same delta again is answered with the same receipt.
            again = await eu.three_step("tiny", 0, manifest, stream)
            assert again == (200, body)

            manifest, stream = us.delta("tiny", 0, first.base_hash, seed=2, tokens=300)
            status, body = await us.single_shot("tiny", 0, manifest, stream)
            assert (status, body["state"]) == (200, "accepted"), body

            second = await announcements.until(round=1, state="open")
            assert second.update_url == "/v1/jobs/tiny/rounds/0/update"
            update, parameters_hash = await eu.download_update("tiny", 0)
            theta1 = {name: theta0[name] + update[name] for name in theta0}
            assert parameters_vector_hash(theta1) == parameters_hash == second.base_hash
            # An interrupted download resumes with a Range request.
            path = "/v1/jobs/tiny/rounds/0/update"
            async with eu.session.get(path) as response:
                whole = await response.read()
            async with eu.session.get(path, headers={"Range": "bytes=100-"}) as response:
                assert response.status == 206
                assert await response.read() == whole[100:]
            # A joiner resyncing from the checkpoint chain reaches the same bits.
            _, resynced_hash, version = await us.download_params("tiny")
            assert (version, resynced_hash) == (1, second.base_hash)

            observer = running.session(setup.observer)
            completed = 'geofed_rounds_completed_total{job="tiny"}'
            assert await metric_value(running, observer, completed) == 1.0
            accepted = 'geofed_deltas_accepted_total{job="tiny",region="eu-west"}'
            assert await metric_value(running, observer, accepted) == 1.0

            # θ_1 is evaluated in the background with the task's held-out loss. The first
            # evaluation starts the evaluation process: allow for its start-up.
            async with asyncio.timeout(120):
                while True:
                    status, job = await request(observer, "GET", "/v1/jobs/tiny")
                    if job["global_val_loss"] is not None and job["global_val_loss"]["round"]:
                        break
                    await asyncio.sleep(0.05)
            assert job["global_val_loss"]["round"] == 1
            loss = await metric_value(
                running, observer, 'geofed_global_validation_loss{job="tiny"}'
            )
            assert loss == job["global_val_loss"]["value"]
            assert loss > 0
            assert [e["round"] for e in job["val_loss_history"]] == [0, 1]
            evaluations = 'geofed_evaluations_total{job="tiny",where="%s"}'
            assert await metric_value(running, observer, evaluations % "coordinator") == 2.0
            assert await metric_value(running, observer, evaluations % "region") == 0.0

            status, audit = await request(observer, "GET", "/v1/audit?limit=1000&verify=1")
            assert status == 200
            assert audit["verify"]["ok"], audit
            entries = [AuditEntry.from_dict(entry) for entry in audit["entries"]]
            assert verify_chain(entries, start_seq=1).ok
            actions = [entry.action for entry in entries]
            assert actions.count("round.publish") == 1
            assert {"job.admit", "delta.accept", "policy.model_delta"} <= set(actions)
            # Each delta was decoded once, by its upload's verification, and summed as it
            # was accepted; the round records that order (eu-west's commit came first).
            (publish,) = [entry for entry in entries if entry.action == "round.publish"]
            assert publish.details["order"] == ["eu-west", "us-east"]
            assert publish.details["summation"] == "folded on arrival"


async def test_a_regions_evaluation_of_its_base_is_the_jobs_loss(tmp_path: Path) -> None:
    # The default: a region evaluates θ_r before training and its delta carries the
    # metrics; the coordinator evaluates only the last θ, which is the base of no round.
    async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
        setup = write_setup(tmp_path, broker.port)
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            spec = job_yaml(task="tests.support.coordinator:EvaluatedTinyTask", rounds=1)
            status, body = await request(operator, "POST", "/v1/jobs", data=spec)
            assert status == 201, body
            first = await announcements.until(round=0, state="open")
            assert first.evaluation.where == "region"

            eu, us = running.region("eu-west"), running.region("us-east")
            evaluated = {"val_loss": 7.25, "val_bits_per_byte": 10.46}
            manifest, stream = eu.delta("tiny", 0, first.base_hash, seed=1, base_eval=evaluated)
            assert (await eu.single_shot("tiny", 0, manifest, stream))[0] == 200
            manifest, stream = us.delta("tiny", 0, first.base_hash, seed=2)
            assert (await us.single_shot("tiny", 0, manifest, stream))[0] == 200

            observer = running.session(setup.observer)
            async with asyncio.timeout(120):
                while True:
                    status, job = await request(observer, "GET", "/v1/jobs/tiny")
                    if len(job["val_loss_history"]) == 2:
                        break
                    await asyncio.sleep(0.05)
            history = {e["round"]: e["value"] for e in job["val_loss_history"]}
            assert history[0] == 7.25  # the region's, as it reported it
            assert history[1] > 0  # the job's result, evaluated by the coordinator
            assert job["global_val_loss"] == {"round": 1, "value": history[1]}
            evaluations = 'geofed_evaluations_total{job="tiny",where="%s"}'
            assert await metric_value(running, observer, evaluations % "region") == 1.0
            assert await metric_value(running, observer, evaluations % "coordinator") == 1.0


async def test_a_restarted_coordinator_evaluates_last_parameters_it_never_kept(
    tmp_path: Path,
) -> None:
    # The last round was published but the coordinator died before the evaluation of θ_1
    # was kept: the store then holds θ_1 and no loss for it. Its evaluation is the job's
    # result, so the restarted coordinator makes it.
    async with EmbeddedBroker() as broker, Announcements(broker.port) as announcements:
        setup = write_setup(tmp_path, broker.port)
        spec = job_yaml(
            task="tests.support.coordinator:EvaluatedTinyTask",
            rounds=1,
            extra="evaluation: {where: coordinator}\n",
        )
        async with coordinator(setup) as running:
            operator = running.session(setup.operator)
            status, body = await request(operator, "POST", "/v1/jobs", data=spec)
            assert status == 201, body
            first = await announcements.until(round=0, state="open")
            for seed, region in enumerate(("eu-west", "us-east"), start=1):
                client = running.region(region)
                manifest, stream = client.delta("tiny", 0, first.base_hash, seed=seed, tokens=100)
                status, body = await client.three_step("tiny", 0, manifest, stream)
                assert (status, body["state"]) == (200, "accepted"), body
            async with asyncio.timeout(120):
                while True:
                    status, job = await request(operator, "GET", "/v1/jobs/tiny")
                    if job["state"] == "completed" and len(job["val_loss_history"]) == 2:
                        break
                    await asyncio.sleep(0.05)
            kept = {e["round"]: e["value"] for e in job["val_loss_history"]}

        database = sqlite3.connect(setup.root / "state" / "coordinator.db")
        with database:  # as a kill before the evaluation of θ_1 was kept leaves the store
            for name, value in (
                (VAL_HISTORY_POINTER, format_history({0: kept[0]})),
                (VAL_LOSS_POINTER, format_val_loss(0, kept[0])),
            ):
                database.execute(
                    "UPDATE pointers SET value = ? WHERE job_id = 'tiny' AND name = ?",
                    (value, name),
                )
        database.close()

        async with coordinator(setup) as running:
            observer = running.session(setup.observer)
            async with asyncio.timeout(120):
                while True:
                    status, job = await request(observer, "GET", "/v1/jobs/tiny")
                    if len(job["val_loss_history"]) == 2:
                        break
                    await asyncio.sleep(0.05)
            assert job["state"] == "completed"
            assert {e["round"]: e["value"] for e in job["val_loss_history"]} == kept
            assert job["global_val_loss"] == {"round": 1, "value": kept[1]}
