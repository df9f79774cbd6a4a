"""The hand-off directory between a regional agent and rank 0 of its worker group: where
each file lives and how it is written (what each carries: :mod:`regional_agent.handoff.messages`).

Everything crosses as files in one work directory, so either side may restart at any
moment and pick up where the other left off::

    jobs/<job>/round-<r>.instruction.json   agent -> workers: train round r from theta_r
    jobs/<job>/round-<r>.result.pt          rank 0: local fp32 parameters, or the sizes of
                                            the quantized delta's frames (an instruction's
                                            ``delta``), + summary
    jobs/<job>/round-<r>.delta.bin          rank 0: that delta, a sealed codec stream the
                                            agent spools as it is (a second name)
    jobs/<job>/round-<r>.residual.pt        rank 0: the residual the quantized delta leaves
                                            (its tensors with the regional checkpoint,
                                            else a held file naming rank 0's copy)
    jobs/<job>/residual-held.pt             rank 0, at a park or stop: the residual it held
    jobs/<job>/round-<r>.done.json          rank 0, written last: the result exists
    jobs/<job>/round-<r>.error.json         rank 0: the instruction cannot be served
    jobs/<job>/round-<r>.progress.json      rank 0: steps done so far (advisory)
    jobs/<job>/round-<r>.base.json          agent -> workers: θ_r of a delayed round is ready
    jobs/<job>/round-<r>.cancel             agent -> workers: drop the delayed round r
    jobs/<job>/round-<r>.start.pt           agent -> workers: S, where an eager round r starts
    jobs/<job>/round-<r>.start.json         agent -> workers, written last: S is ready
    jobs/<job>/regional-checkpoint.json     rank 0, every round: the job's last round, data
                                            cursor, and which optimizer state is saved
    jobs/<job>/optimizer-round-<r>/         every rank its part (DCP): the inner optimizer
                                            state at the end of round r
    jobs/<job>/checkpoint-asked             agent -> workers: save the regional checkpoint
                                            at the end of round r or the first one after
    jobs/<job>/inner-checkpoint.pt          rank 0, last: a round stopped mid-way (its step,
                                            each rank's RNG states and totals)
    jobs/<job>/inner-checkpoint/            every rank its part (DCP): that round's
                                            parameters and optimizer state
    ranks/rank-<n>.json                     each rank: pid, launch id, restart count
    logs/rank-<n>.log, logs/launcher.log    worker and launcher output
    stop                                    agent -> workers: finish and exit 0

Results, checkpoints, markers and instructions are written temp + fsync + rename; a
result exists only once its done marker does. The regional checkpoint is per job, so jobs
that share the group never resume from each other's state: a small record written with
every round, and the sharded optimizer state it names, saved every few rounds
(:mod:`regional_agent.worker.optimizer_checkpoint`). A whole-state checkpoint of the format
before (``regional-checkpoint.pt``, per job or at the root) is still read and resumed
from; one at the old single-file place is moved to its job's place by
:meth:`HandoffDir.migrate_legacy_checkpoint`. Progress and rank status files are
advisory and only renamed into place (whole, not durable). All functions here block on
disk I/O; asyncio callers run them in a thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from geofed.codec import CodecError, QuantizedTensors
from geofed.fsutil import AtomicFile, atomic_write_bytes, replace_durably
from geofed.types import validate_name
from regional_agent.handoff.delta_stream import (
    DeltaStream,
    WrittenDelta,
    open_delta_stream,
    write_delta_stream,
)
from regional_agent.handoff.errors import HandoffError, InvalidHandoffData
from regional_agent.handoff.messages import (
    FORMAT_VERSION,
    BaseReady,
    RankStatus,
    RegionalCheckpoint,
    RoundInstruction,
    RoundProgress,
    RoundResult,
    RoundSummary,
    StartReady,
    require_int,
)

_CHECKPOINT_NAME = "regional-checkpoint.pt"
_RECORD_NAME = "regional-checkpoint.json"
_INNER_CHECKPOINT_NAME = "inner-checkpoint.pt"
_CHECKPOINT_ASK_NAME = "checkpoint-asked"
_OPTIMIZER_DIR_RE = re.compile(r"optimizer-round-(\d+)")
_ROUND_FILE_RE = re.compile(r"^round-(\d+)\.instruction\.json$")


@dataclass(frozen=True, slots=True)
class ErrorMarker:
    """Why the workers could not serve an instruction; ``refused``: they decline it."""

    message: str
    refused: bool = False


def inner_tensors_dir(path: Path) -> Path:
    """Where the sharded tensors of the inner checkpoint file at ``path`` are saved."""
    return path.with_suffix("")


class HandoffDir:
    """The hand-off files of one worker group, rooted at ``root``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    # -- paths -------------------------------------------------------------------------

    def job_dir(self, job: str) -> Path:
        return self.root / "jobs" / validate_name("job", job)

    def _round_path(self, job: str, round_: int, suffix: str) -> Path:
        require_int("round", round_, 0)
        return self.job_dir(job) / f"round-{round_}.{suffix}"

    def instruction_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "instruction.json")

    def result_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "result.pt")

    def delta_stream_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "delta.bin")

    def residual_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "residual.pt")

    def held_residual_path(self, job: str) -> Path:
        """Where rank 0 writes out the residual it held when it parks ``job`` or stops."""
        return self.job_dir(job) / "residual-held.pt"

    def done_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "done.json")

    def error_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "error.json")

    def progress_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "progress.json")

    def base_ready_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "base.json")

    def cancel_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "cancel")

    def start_params_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "start.pt")

    def start_ready_path(self, job: str, round_: int) -> Path:
        return self._round_path(job, round_, "start.json")

    def checkpoint_path(self, job: str) -> Path:
        """``job``'s regional checkpoint record, beside its round files."""
        return self.job_dir(job) / _RECORD_NAME

    def whole_checkpoint_path(self, job: str) -> Path:
        """Where a whole-state checkpoint of the format before is kept for ``job``."""
        return self.job_dir(job) / _CHECKPOINT_NAME

    def optimizer_path(self, job: str, round_: int) -> Path:
        """The sharded inner optimizer state of ``job`` at the end of ``round_``."""
        return self.job_dir(job) / f"optimizer-round-{round_}"

    def optimizer_rounds(self, job: str) -> list[int]:
        """The rounds whose optimizer state directories ``job`` has (finished or not)."""
        job_dir = self.job_dir(job)
        if not job_dir.is_dir():
            return []
        found = (_OPTIMIZER_DIR_RE.fullmatch(entry.name) for entry in job_dir.iterdir())
        return sorted(int(m.group(1)) for m in found if m is not None)

    def inner_checkpoint_path(self, job: str) -> Path:
        """The inner state of ``job``'s round stopped mid-way (see
        :mod:`regional_agent.worker.inner_checkpoint`)."""
        return self.job_dir(job) / _INNER_CHECKPOINT_NAME

    @property
    def legacy_checkpoint_path(self) -> Path:
        """Where groups kept the region's one checkpoint before it was per job."""
        return self.root / _CHECKPOINT_NAME

    @property
    def stop_path(self) -> Path:
        return self.root / "stop"

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    def rank_log_path(self, rank: int) -> Path:
        return self.log_dir / f"rank-{require_int('rank', rank, 0)}.log"

    @property
    def launcher_log_path(self) -> Path:
        return self.log_dir / "launcher.log"

    def rank_status_path(self, rank: int) -> Path:
        return self.root / "ranks" / f"rank-{require_int('rank', rank, 0)}.json"

    # -- instructions --------------------------------------------------------------------

    def write_instruction(self, instruction: RoundInstruction) -> Path:
        """Atomically write (or rewrite) an instruction; rewriting makes it the newest."""
        path = self.instruction_path(instruction.job, instruction.round)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, instruction.to_json())
        return path

    def read_instruction(self, job: str, round_: int) -> RoundInstruction:
        path = self.instruction_path(job, round_)
        instruction = RoundInstruction.from_json(path.read_bytes(), source=str(path))
        if (instruction.job, instruction.round) != (job, round_):
            raise InvalidHandoffData(
                f"{path}: names job {instruction.job!r} round {instruction.round}, "
                f"not job {job!r} round {round_}"
            )
        return instruction

    def pending_instruction(self) -> tuple[str, int] | None:
        """Return (job, round) of the newest instruction if it is neither done nor failed.

        Newest means last written (modification time, then round number). Older
        instructions left without an outcome were superseded and are never served.
        """
        newest: tuple[int, int, str] | None = None
        jobs = self.root / "jobs"
        if not jobs.is_dir():
            return None
        for job_dir in jobs.iterdir():
            if not job_dir.is_dir():
                continue
            for entry in job_dir.iterdir():
                match = _ROUND_FILE_RE.fullmatch(entry.name)
                if match is None:
                    continue
                try:
                    mtime = entry.stat().st_mtime_ns
                except FileNotFoundError:  # pruned while scanning
                    continue
                key = (mtime, int(match.group(1)), job_dir.name)
                if newest is None or key > newest:
                    newest = key
        if newest is None:
            return None
        _, round_, job = newest
        if self.done_path(job, round_).exists() or self.error_path(job, round_).exists():
            return None
        return job, round_

    # -- delayed rounds ------------------------------------------------------------------

    def write_base_ready(self, ready: BaseReady) -> None:
        """Tell the workers of a delayed round that θ is at ``ready.base_params`` (durable)."""
        path = self.base_ready_path(ready.job, ready.round)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, ready.to_json())

    def read_base_ready(self, job: str, round_: int) -> BaseReady | None:
        path = self.base_ready_path(job, round_)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        return BaseReady.from_json(raw, str(path))

    def request_cancel(self, job: str, round_: int) -> None:
        """Ask the workers to drop the delayed round ``round_`` (see the worker)."""
        path = self.cancel_path(job, round_)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, b"cancel\n")

    def cancel_requested(self, job: str, round_: int) -> bool:
        return self.cancel_path(job, round_).exists()

    def clear_cancel(self, job: str, round_: int) -> None:
        self.cancel_path(job, round_).unlink(missing_ok=True)

    def write_start(
        self,
        job: str,
        round_: int,
        params: Mapping[str, torch.Tensor] | None,
        params_hash: str = "",
        reason: str = "",
    ) -> StartReady:
        """Hand an eager round its start S (durable), then the marker; ``params`` None:
        the workers start from their own parameters."""
        path = self.start_params_path(job, round_)
        path.parent.mkdir(parents=True, exist_ok=True)
        if params is None:
            ready = StartReady(job, round_, reason=reason)
        else:
            with AtomicFile(path) as f:
                torch.save(dict(params), f)
            ready = StartReady(job, round_, str(path), params_hash, reason)
        atomic_write_bytes(self.start_ready_path(job, round_), ready.to_json())
        return ready

    def read_start_ready(self, job: str, round_: int) -> StartReady | None:
        path = self.start_ready_path(job, round_)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        return StartReady.from_json(raw, str(path))

    # -- outcomes ------------------------------------------------------------------------

    def write_result(
        self,
        summary: RoundSummary,
        params: Mapping[str, torch.Tensor] | None = None,
        delta: QuantizedTensors | WrittenDelta | None = None,
    ) -> None:
        """Atomically write the result file (not yet visible as a result: see write_done):
        the trained ``params``, or the quantized ``delta``, sealed into the round's stream
        file first unless it was sealed there as it was quantized (a
        :class:`~regional_agent.handoff.delta_stream.WrittenDelta`; its residual file
        written before, :mod:`regional_agent.handoff.residual_file`)."""
        if (params is None) == (delta is None):
            raise HandoffError("a result holds either the parameters or the delta")
        path = self.result_path(summary.job, summary.round)
        path.parent.mkdir(parents=True, exist_ok=True)
        body: dict[str, Any] = {"format": FORMAT_VERSION, "summary": asdict(summary)}
        if params is not None:
            body["params"] = dict(params)
        if delta is not None:
            stream = self.delta_stream_path(summary.job, summary.round)
            if isinstance(delta, WrittenDelta):
                if delta.path != stream:
                    raise HandoffError(f"the round's delta is at {stream}, not {delta.path}")
                body["stream"] = {"frames": list(delta.frames)}
            else:
                body["stream"] = {"frames": list(write_delta_stream(stream, delta))}
        with AtomicFile(path) as f:
            torch.save(body, f)

    def has_result_file(self, job: str, round_: int) -> bool:
        return self.result_path(job, round_).is_file()

    def read_result_file(self, job: str, round_: int) -> RoundResult:
        """Load a result file whether or not its done marker exists yet."""
        path = self.result_path(job, round_)
        try:
            body = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise InvalidHandoffData(f"{path}: unreadable result: {exc}") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT_VERSION:
            raise InvalidHandoffData(f"{path}: not a format-{FORMAT_VERSION} result file")
        summary = RoundSummary.from_json(json.dumps(body.get("summary")).encode(), str(path))
        if (summary.job, summary.round) != (job, round_):
            raise InvalidHandoffData(f"{path}: holds job {summary.job!r} round {summary.round}")
        if "stream" in body or "delta" in body:
            residual = self.residual_path(job, round_)
            if not residual.is_file():
                raise InvalidHandoffData(f"{path}: its residual file {residual} is missing")
            delta = self._delta_stream(job, round_, body)
            return RoundResult(summary=summary, delta=delta, residual=residual)
        params = body.get("params")
        if not isinstance(params, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in params.items()
        ):
            raise InvalidHandoffData(f"{path}: params must map names to tensors")
        return RoundResult(summary=summary, params=params)

    def _delta_stream(self, job: str, round_: int, body: Mapping[str, Any]) -> DeltaStream:
        """The delta a result file names; one of a worker of the format before (its
        payloads in the result file itself) is sealed into the stream file here."""
        path, where = self.result_path(job, round_), self.delta_stream_path(job, round_)
        if "stream" in body:
            stream = body["stream"]
            frames = stream.get("frames") if isinstance(stream, dict) else None
            if not isinstance(frames, list):
                raise InvalidHandoffData(f"{path}: 'stream' must list its frames' sizes")
            return open_delta_stream(where, frames)
        try:
            quantized = QuantizedTensors.from_state(body["delta"], f"{path}: delta")
            return open_delta_stream(where, write_delta_stream(where, quantized))
        except CodecError as exc:
            raise InvalidHandoffData(str(exc)) from None

    def write_done(self, summary: RoundSummary) -> None:
        """Publish a result: write its marker last, after the result file is durable."""
        if not self.has_result_file(summary.job, summary.round):
            raise HandoffError(
                f"no result file for job {summary.job!r} round {summary.round}; "
                "a done marker must follow its result"
            )
        atomic_write_bytes(self.done_path(summary.job, summary.round), summary.to_json())

    def read_done(self, job: str, round_: int) -> RoundSummary | None:
        """Return the summary of a completed round, or None if it is not complete."""
        path = self.done_path(job, round_)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        return RoundSummary.from_json(raw, str(path))

    def read_completed(self, job: str, round_: int) -> RoundResult | None:
        """Return a completed round's result (done marker present), else None."""
        summary = self.read_done(job, round_)
        if summary is None:
            return None
        result = self.read_result_file(job, round_)
        if result.summary != summary:
            raise InvalidHandoffData(
                f"{self.result_path(job, round_)} does not match its done marker"
            )
        return result

    def write_error(self, job: str, round_: int, message: str, *, refused: bool = False) -> None:
        """Say the instruction cannot be served, and why; ``refused``: the workers decline
        it themselves (the task's files here are not the coordinator's), which the agent
        reports as the region's own refusal rather than a failure."""
        path = self.error_path(job, round_)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"format": FORMAT_VERSION, "job": job, "round": round_, "message": message}
        if refused:
            body["refused"] = True
        atomic_write_bytes(path, json.dumps(body).encode())

    def read_error(self, job: str, round_: int) -> str | None:
        marker = self.read_error_marker(job, round_)
        return None if marker is None else marker.message

    def read_error_marker(self, job: str, round_: int) -> ErrorMarker | None:
        """The round's error marker (None: there is none); one that does not parse says so."""
        try:
            raw = self.error_path(job, round_).read_bytes()
        except FileNotFoundError:
            return None
        try:
            body = json.loads(raw)
            message, refused = body["message"], body.get("refused", False)
        except (ValueError, KeyError, TypeError, AttributeError):
            return ErrorMarker(f"unreadable error marker {self.error_path(job, round_)}")
        return ErrorMarker(str(message), refused is True)

    def clear_error(self, job: str, round_: int) -> None:
        self.error_path(job, round_).unlink(missing_ok=True)

    def write_progress(self, progress: RoundProgress) -> None:
        _replace_quickly(self.progress_path(progress.job, progress.round), asdict(progress))

    def read_progress(self, job: str, round_: int) -> RoundProgress | None:
        data = _read_json_or_none(self.progress_path(job, round_))
        try:
            return None if data is None else RoundProgress(**data)
        except (TypeError, InvalidHandoffData):
            return None

    def prune_rounds(self, job: str, before_round: int) -> int:
        """Delete the files of ``job``'s rounds below ``before_round``; return how many rounds.

        The done marker goes first, so a half-pruned round reads as not completed rather
        than as a completed round with a missing result.
        """
        job_dir = self.job_dir(job)
        if not job_dir.is_dir():
            return 0
        rounds = {
            int(m.group(1))
            for entry in job_dir.iterdir()
            if (m := re.fullmatch(r"round-(\d+)\..+", entry.name)) is not None
        }
        pruned = 0
        for round_ in sorted(r for r in rounds if r < before_round):
            for suffix in (
                "done.json",
                "result.pt",
                "delta.bin",
                "residual.pt",
                "error.json",
                "progress.json",
                "base.json",
                "cancel",
                "start.json",
                "start.pt",
            ):
                self._round_path(job, round_, suffix).unlink(missing_ok=True)
            self.instruction_path(job, round_).unlink(missing_ok=True)
            pruned += 1
        return pruned

    def forget_job(self, job: str) -> None:
        """Drop ``job``'s round files, its regional checkpoint (record, saved optimizer
        states, a whole-state or legacy one too) and inner checkpoint.

        File by file, never the directory: the worker scans it while idle. A worker whose
        in-memory state is past a round asked again, and that finds no regional checkpoint,
        takes this as the agent's discard and starts afresh (see the worker).
        """
        job_dir = self.job_dir(job)
        if job_dir.is_dir():
            # Instructions first: a round whose done marker went before its instruction
            # would read as pending, and an idle worker would train it again.
            for entry in job_dir.iterdir():
                if _ROUND_FILE_RE.fullmatch(entry.name) is not None:
                    entry.unlink(missing_ok=True)
        self.prune_rounds(job, sys.maxsize)
        self.inner_checkpoint_path(job).unlink(missing_ok=True)
        shutil.rmtree(inner_tensors_dir(self.inner_checkpoint_path(job)), ignore_errors=True)
        self.checkpoint_path(job).unlink(missing_ok=True)
        self.whole_checkpoint_path(job).unlink(missing_ok=True)
        (self.job_dir(job) / _CHECKPOINT_ASK_NAME).unlink(missing_ok=True)
        self.remove_optimizer_states(job)
        legacy = self.legacy_checkpoint_path
        try:
            owner = self._load_checkpoint(legacy)
        except InvalidHandoffData:
            owner = None  # unreadable: no job can resume from it anyway
            legacy.unlink(missing_ok=True)
        if owner is not None and owner.job == job:
            legacy.unlink(missing_ok=True)

    # -- regional checkpoint -------------------------------------------------------------

    def write_checkpoint(self, checkpoint: RegionalCheckpoint) -> None:
        """Atomically replace the regional checkpoint record of ``checkpoint.job``.

        A whole-state checkpoint of the format before goes once the record is durable.
        """
        path = self.checkpoint_path(checkpoint.job)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, checkpoint.record())
        self.whole_checkpoint_path(checkpoint.job).unlink(missing_ok=True)

    def ask_checkpoint(self, job: str, round_: int) -> None:
        """Ask the workers for ``job``'s regional checkpoint at the end of round ``round_``
        (or of the first round they finish after it): the coordinator asked, for the
        region's hardware risk."""
        path = self.job_dir(job) / _CHECKPOINT_ASK_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, f"{round_}\n".encode())

    def checkpoint_asked(self, job: str) -> int | None:
        """The round from which ``job``'s regional checkpoint was asked for (None: never,
        or the ask is unreadable: the cadence alone decides)."""
        try:
            return int((self.job_dir(job) / _CHECKPOINT_ASK_NAME).read_text().strip())
        except (OSError, ValueError):
            return None

    def has_checkpoint(self, job: str) -> bool:
        return self.checkpoint_path(job).is_file() or self.whole_checkpoint_path(job).is_file()

    def read_checkpoint(self, job: str) -> RegionalCheckpoint | None:
        """``job``'s regional checkpoint (its record, else a whole-state one), or None."""
        path = self.checkpoint_path(job)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            path = self.whole_checkpoint_path(job)
            checkpoint = self._load_checkpoint(path)
        except OSError as exc:
            raise InvalidHandoffData(f"{path}: unreadable regional checkpoint: {exc}") from None
        else:
            checkpoint = RegionalCheckpoint.from_record(raw, str(path))
        if checkpoint is not None and checkpoint.job != job:
            raise InvalidHandoffData(f"{path}: holds the state of job {checkpoint.job!r}")
        return checkpoint

    def remove_optimizer_states(self, job: str, keep: Collection[int | None] = ()) -> None:
        """Remove ``job``'s saved optimizer states but those of the rounds in ``keep``
        (this node's files)."""
        for round_ in self.optimizer_rounds(job):
            if round_ not in keep:
                # Ranks sharing a filesystem remove the same directories: a race, no error.
                shutil.rmtree(self.optimizer_path(job, round_), ignore_errors=True)

    def migrate_legacy_checkpoint(self) -> str | None:
        """Move a checkpoint at the old single-file place to its job's place, once.

        Returns the job it belonged to, or None when there was none to move. A job that
        already has its own checkpoint keeps it (written later than any legacy file), and
        the legacy file goes. An unreadable legacy file raises
        :class:`InvalidHandoffData` and stays where it is, unused, until :meth:`forget_job`
        of any job removes it. Call it while no rank reads checkpoints (rank 0, before the
        group's first collective).
        """
        legacy = self.legacy_checkpoint_path
        checkpoint = self._load_checkpoint(legacy)
        if checkpoint is None:
            return None
        if self.has_checkpoint(checkpoint.job):
            legacy.unlink(missing_ok=True)
        else:
            target = self.whole_checkpoint_path(checkpoint.job)
            target.parent.mkdir(parents=True, exist_ok=True)
            replace_durably(legacy, target)
        return checkpoint.job

    def _load_checkpoint(self, path: Path) -> RegionalCheckpoint | None:
        """A whole-state checkpoint of the format before, or None if there is none."""
        try:
            # Mapped, not read: a rank that does not load the optimizer state (FSDP ranks
            # other than 0) never pages it in.
            body = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise InvalidHandoffData(f"{path}: unreadable regional checkpoint: {exc}") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT_VERSION:
            raise InvalidHandoffData(f"{path}: not a format-{FORMAT_VERSION} regional checkpoint")
        try:
            checkpoint = RegionalCheckpoint(
                job=validate_name("job", body["job"]),
                last_round=require_int("last_round", body["last_round"], 0),
                cursor=require_int("cursor", body["cursor"], 0),
                world_size=require_int("world_size", body["world_size"], 1),
                optimizer_state=body["optimizer_state"],
                parallelism=body.get("parallelism", "ddp"),
            )
        except (KeyError, ValueError) as exc:
            raise InvalidHandoffData(f"{path}: {exc}") from None
        if not isinstance(checkpoint.optimizer_state, dict):
            raise InvalidHandoffData(f"{path}: optimizer_state is not a state dict")
        return checkpoint

    # -- stop flag and rank status -------------------------------------------------------

    def request_stop(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.stop_path, b"stop\n")

    def clear_stop(self) -> None:
        self.stop_path.unlink(missing_ok=True)

    def stop_requested(self) -> bool:
        return self.stop_path.exists()

    def write_rank_status(self, status: RankStatus) -> None:
        _replace_quickly(self.rank_status_path(status.rank), asdict(status))

    def read_rank_statuses(self) -> list[RankStatus]:
        """Every rank's latest status; unreadable files are skipped (they are advisory)."""
        directory = self.root / "ranks"
        if not directory.is_dir():
            return []
        statuses: list[RankStatus] = []
        for path in sorted(directory.glob("rank-*.json")):
            data = _read_json_or_none(path)
            with contextlib.suppress(TypeError, InvalidHandoffData):
                if data is not None:
                    statuses.append(RankStatus(**data))
        return statuses


def _replace_quickly(path: Path, data: Mapping[str, Any]) -> None:
    """Rename a whole JSON file into place without fsync (for advisory files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(dict(data)).encode(), durable=False)


def _read_json_or_none(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None
