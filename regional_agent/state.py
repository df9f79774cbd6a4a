"""The agent's durable regional state: θ, the error-feedback residual, spooled deltas.

Everything here stays in the region (its policy keeps ``regional_checkpoint`` home); the
worker group keeps the rest of the regional checkpoint (inner optimizer state, data
cursor) in its own hand-off directory. Layout under the state directory::

    jobs/<job>/params/round-<v>.chain.json
                                        θ_v: a θ file and the updates after it
                                        (:mod:`geofed.theta_chain`; immutable); the workers
                                        are given this path
    jobs/<job>/params/round-<v>.safetensors
                                        θ_v written whole, a θ file (:mod:`geofed.theta_file`;
                                        immutable): after a resync, and every
                                        ``transfer.theta_file_every`` rounds
    jobs/<job>/params/update-<r>.bundle round r's verified update, kept while a chain names it
    jobs/<job>/params/current.json      {"round": v, "hash": ..., "file": ...}: which θ is
                                        held (and its chain file's size, mtime, inode), last
    jobs/<job>/downloads/               an update or snapshot being downloaded, until applied
    jobs/<job>/feedback.pt              error-feedback residual after the last accepted delta
                                        (or a held file: rank 0 keeps its tensors)
    jobs/<job>/progress.json            {"uploaded_round": r}: last delta the coordinator took
    jobs/<job>/eager.pt                 overlap_start eager: the outer optimizer's replica and
                                        the last raw delta
                                        (:mod:`regional_agent.rounds.eager_start`)
    jobs/<job>/spool/round-<r>/         one encoded delta, kept until it is accepted:
        stream.bin                      the codec frames, concatenated
        residual.pt                     the residual this delta leaves behind (or a held file)
        meta.json                       train loss, tokens, hash of the θ it trained from
        manifest.json                   the signed manifest, written last

Every file is written temp + fsync + rename (:mod:`geofed.fsutil`), and a thing exists
only once the file naming it does (``current.json``, ``manifest.json``), so a crash at
any point leaves the previous state readable. The residual advances only when a delta
is accepted (:meth:`JobDirectory.promote`): a delta that never reached the coordinator
leaves nothing of itself behind. All methods block on disk I/O; the agent calls them
through ``asyncio.to_thread``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from geofed.codec import ErrorFeedback, ErrorFeedbackError
from geofed.fsutil import AtomicFile, atomic_write_bytes, fsync_dir, replace_durably
from geofed.manifest import ManifestError, SignedManifest, verify_chunk
from geofed.theta_chain import ThetaChain, params_hash
from geofed.theta_file import ThetaFileError, write_theta
from geofed.types import validate_name
from regional_agent.handoff.residual_file import (
    HeldResidual,
    ResidualFileError,
    read_residual,
    write_residual,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_PARAMS_RE = re.compile(r"^round-(\d+)\.(?:safetensors|pt)$")
_CHAIN_RE = re.compile(r"^round-(\d+)\.chain\.json$")
_UPDATE_RE = re.compile(r"^update-(\d+)\.bundle$")
_SPOOL_RE = re.compile(r"^round-(\d+)$")
#: θ chains (and the files they name) kept besides the current one, for a worker group
#: still reading an older one.
_KEEP_OLD_PARAMS = 1


class StateError(Exception):
    """The regional state on disk is unreadable or inconsistent; the message names the file."""


class ProgressDamaged(StateError):
    """A job's progress record is unreadable; what the coordinator holds can rebuild it."""


@dataclass(frozen=True, slots=True)
class ParamsVersion:
    """Which global parameters are held: θ of ``round`` with hash ``hash``."""

    round: int
    hash: str


@dataclass(frozen=True)
class HeldTheta:
    """The θ a job holds: its version and its file."""

    version: ParamsVersion
    path: Path


@dataclass(frozen=True, slots=True)
class DeltaMeta:
    """What the agent reports with a spooled delta."""

    train_loss: float
    tokens: int
    params_hash: str

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT_VERSION,
            "train_loss": self.train_loss,
            "tokens": self.tokens,
            "params_hash": self.params_hash,
        }
        return json.dumps(body, sort_keys=True).encode()


@dataclass(frozen=True)
class SpooledDelta:
    """A delta on disk, ready to (re)send: its signed manifest and its frames."""

    round: int
    manifest_bytes: bytes
    manifest: SignedManifest
    meta: DeltaMeta
    stream_path: Path

    @property
    def frame_count(self) -> int:
        return len(self.manifest.manifest.chunks)

    def read_frame(self, index: int) -> bytes:
        """Frame ``index`` of the stream (blocking), as the manifest records its size."""
        chunks = self.manifest.manifest.chunks
        if not 0 <= index < len(chunks):
            raise StateError(f"spooled delta of round {self.round} has no frame {index}")
        offset = sum(record.size for record in chunks[:index])
        with self.stream_path.open("rb") as f:
            f.seek(offset)
            data = f.read(chunks[index].size)
        if len(data) != chunks[index].size:
            raise StateError(f"{self.stream_path}: truncated at frame {index}")
        return data

    def verify(self) -> None:
        """Check every frame against the signed manifest (blocking, one frame at a time);
        :class:`StateError` naming the first that differs."""
        manifest = self.manifest.manifest
        with self.stream_path.open("rb") as f:
            for index, record in enumerate(manifest.chunks):
                try:
                    verify_chunk(manifest, index, f.read(record.size))
                except ManifestError as exc:
                    raise StateError(f"{self.stream_path}: {exc}") from None


class JobDirectory:
    """One job's directory of regional state, ``root/jobs/<job>`` (see the module docstring)."""

    def __init__(self, root: Path, job: str) -> None:
        self.job = validate_name("job", job)
        self.root = root / "jobs" / job
        self._params = self.root / "params"
        self._downloads = self.root / "downloads"
        self._spool = self.root / "spool"

    # -- θ ----------------------------------------------------------------------------

    def params_path(self, round_: int) -> Path:
        """Where θ_round is written whole, as a θ file."""
        return self._params / f"round-{round_}.safetensors"

    def held_path(self, round_: int) -> Path:
        """The description of θ_round as the agent holds it (:mod:`geofed.theta_chain`):
        its θ file, or an earlier one and the updates after it."""
        return self._params / f"round-{round_}.chain.json"

    def update_path(self, round_: int) -> Path:
        """Where round ``round_``'s verified update is kept for a chain."""
        return self._params / f"update-{round_}.bundle"

    def prepare_params(self) -> None:
        """Create the directories θ files (:meth:`params_path`) and the downloads that
        reach them (:meth:`download_path`) are written in; remove downloads a sync that
        did not finish left behind."""
        self._params.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._downloads.mkdir(mode=0o700, parents=True, exist_ok=True)
        for entry in self._downloads.iterdir():
            entry.unlink(missing_ok=True)

    def download_path(self, name: str) -> Path:
        """Where a downloaded artifact named ``name`` is kept until it is applied."""
        if Path(name).name != name or name in ("", ".", ".."):
            raise StateError(f"a download's name is a file name, not {name!r}")
        return self._downloads / name

    def current_version(self) -> ParamsVersion | None:
        """The θ held, as recorded; None when nothing is held."""
        return self._current()[0]

    def _current(self) -> tuple[ParamsVersion | None, object]:
        """The θ held as recorded, and its file's identity then (None if not recorded)."""
        data = _read_json(self._params / "current.json")
        if data is None:
            return None, None
        try:
            version = ParamsVersion(round=int(data["round"]), hash=str(data["hash"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"{self._params / 'current.json'}: {exc}") from None
        return version, data.get("file")

    def load_params(self) -> HeldTheta | None:
        """The θ held and its file; None when nothing (or nothing intact) is held.

        A θ whose files (its chain's and every file the chain names) have the sizes,
        modification times and inodes recorded when it was made the one held is taken as
        it was hashed then; any other (changed since, or recorded by an agent of the format
        before) is re-hashed, read in chunks. A θ
        that no longer matches its recorded hash, or a θ of the format before (a
        torch.save file), is dropped (with a warning), so the caller resyncs rather than
        training from damaged state. (Rank 0 hashes the θ it trains from every round too.)
        """
        version, recorded = self._current()
        if version is None:
            return None
        path = self.held_path(version.round)
        if recorded is not None and recorded == _held_identity(path):
            return HeldTheta(version, path)
        try:
            if not path.exists():  # held by an agent that wrote θ files only
                ThetaChain(self.params_path(version.round), version.round).save(path)
            found = params_hash(path)
        except ThetaFileError as exc:
            log.warning("dropping the held parameters: %s", exc)
            self.forget_params()
            return None
        if found != version.hash:
            log.warning("dropping %s: hash %s is not the recorded %s", path, found, version.hash)
            self.forget_params()
            return None
        return HeldTheta(version, path)

    def record_params(self, version: ParamsVersion) -> Path:
        """Make θ of ``version``, already described at :meth:`held_path` and hashed, the
        one held (with its files' identities: :meth:`load_params` need not hash it again);
        prune the files no chain kept needs."""
        path = self.held_path(version.round)
        body = {
            "format": FORMAT_VERSION,
            "round": version.round,
            "hash": version.hash,
            "file": _held_identity(path),
        }
        atomic_write_bytes(self._params / "current.json", json.dumps(body).encode())
        self._prune_params(version.round)
        return path

    def save_params(self, version: ParamsVersion, params: Mapping[str, Tensor]) -> Path:
        """Store θ of ``version`` (its tensors) and make it the one held."""
        self.prepare_params()
        write_theta(self.params_path(version.round), params)
        ThetaChain(self.params_path(version.round), version.round).save(
            self.held_path(version.round)
        )
        return self.record_params(version)

    def forget_params(self) -> None:
        """Hold no θ any more: the next sync is a full resync."""
        (self._params / "current.json").unlink(missing_ok=True)
        # The replica followed the θ chain now dropped: it starts again from zero.
        self.forget_eager()

    # -- eager start (overlap_start: eager) -------------------------------------------

    @property
    def eager_path(self) -> Path:
        return self.root / "eager.pt"

    def load_eager(self) -> dict[str, Any] | None:
        """The saved eager-start state, None when there is none or it is unreadable."""
        if not self.eager_path.exists():
            return None
        try:
            return _load(self.eager_path)
        except StateError as exc:
            log.warning("dropping the eager-start state: %s", exc)
            return None

    def save_eager(self, state: Mapping[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with AtomicFile(self.eager_path, private=True) as f:
            torch.save(dict(state), f)

    def forget_eager(self) -> None:
        self.eager_path.unlink(missing_ok=True)

    def _prune_params(self, current: int) -> None:
        """Remove every θ file, chain and kept update that neither the held θ's chain nor
        the newest older one (a worker group may still read it) names."""
        chains = sorted(
            int(m.group(1))
            for entry in self._params.iterdir()
            if (m := _CHAIN_RE.fullmatch(entry.name)) is not None
        )
        older = [round_ for round_ in chains if round_ < current][-_KEEP_OLD_PARAMS:]
        keep: set[str] = set()
        for round_ in (*older, current):
            path = self.held_path(round_)
            keep.add(path.name)
            try:
                chain = ThetaChain.load(path)
            except ThetaFileError:
                continue
            keep.add(chain.base.name)
            keep.update(update.path.name for update in chain.updates)
        for entry in self._params.iterdir():
            name = entry.name
            ours = any(r.fullmatch(name) for r in (_PARAMS_RE, _CHAIN_RE, _UPDATE_RE))
            if ours and name not in keep:
                entry.unlink(missing_ok=True)

    # -- error feedback ---------------------------------------------------------------

    @property
    def feedback_path(self) -> Path:
        """The residual after the last accepted delta
        (:mod:`regional_agent.handoff.residual_file`)."""
        return self.root / "feedback.pt"

    def load_feedback(self) -> ErrorFeedback:
        """The residual after the last accepted delta (empty at the start of a job)."""
        feedback = ErrorFeedback()
        path = self.feedback_path
        if not path.exists():
            return feedback
        try:
            read = read_residual(path)
        except ResidualFileError as exc:
            raise StateError(str(exc)) from None
        if isinstance(read, HeldResidual):
            # The workers keep that residual on their devices; this agent-side encoding (a
            # result holding parameters) cannot reach it.
            log.warning("%s names a residual the workers hold; encoding without it", path)
            return feedback
        try:
            residual = {} if read is None else {n: read.tensors[n] for n in read.tensors}
            feedback.load_state_dict({**feedback.state_dict(), "residual": residual})
        except (ResidualFileError, ErrorFeedbackError) as exc:
            raise StateError(f"{path}: not an error-feedback state: {exc}") from None
        return feedback

    # -- spooled deltas ---------------------------------------------------------------

    def spool_dir(self, round_: int) -> Path:
        return self._spool / f"round-{round_}"

    def write_spool(
        self,
        round_: int,
        manifest_bytes: bytes,
        frames: list[bytes] | Path,
        residual: ErrorFeedback | Path,
        meta: DeltaMeta,
    ) -> SpooledDelta:
        """Store a delta before anything of it is sent; the manifest goes last.

        ``frames`` are the stream's frames, or the stream file rank 0 wrote (its frames
        those the manifest describes), linked here. ``residual`` is the error feedback the
        delta leaves, or the durable residual file rank 0 wrote beside it
        (:mod:`regional_agent.handoff.residual_file`), linked here too.
        """
        directory = self.spool_dir(round_)
        if directory.exists():
            shutil.rmtree(directory)  # an incomplete spool (no manifest) from a crash
        directory.mkdir(parents=True)
        if isinstance(frames, Path):
            _second_name(frames, directory / "stream.bin")
        else:
            with AtomicFile(directory / "stream.bin", private=True) as f:
                for frame in frames:
                    f.write(frame)
        if isinstance(residual, Path):
            _second_name(residual, directory / "residual.pt")
        else:
            write_residual(directory / "residual.pt", round_, residual.residual)
        fsync_dir(directory)
        atomic_write_bytes(directory / "meta.json", meta.to_json())
        atomic_write_bytes(directory / "manifest.json", manifest_bytes)
        fsync_dir(self._spool)
        spooled = self.read_spool(round_)
        if spooled is None:
            raise StateError(f"{directory}: spool vanished while it was written")
        return spooled

    def read_spool(self, round_: int) -> SpooledDelta | None:
        """The complete spooled delta of ``round_``, or None (none, or never finished)."""
        directory = self.spool_dir(round_)
        try:
            manifest_bytes = (directory / "manifest.json").read_bytes()
        except FileNotFoundError:
            return None
        try:
            manifest = SignedManifest.from_bytes(manifest_bytes)
            meta_data = json.loads((directory / "meta.json").read_bytes())
            meta = DeltaMeta(
                train_loss=float(meta_data["train_loss"]),
                tokens=int(meta_data["tokens"]),
                params_hash=str(meta_data["params_hash"]),
            )
        except (OSError, ValueError, KeyError, TypeError, ManifestError) as exc:
            raise StateError(f"{directory}: unreadable spooled delta: {exc}") from None
        try:
            size = (directory / "stream.bin").stat().st_size
        except FileNotFoundError:
            raise StateError(f"{directory}: the spooled delta has no stream.bin") from None
        declared = manifest.manifest.total_size
        if size != declared:
            raise StateError(f"{directory}/stream.bin holds {size} bytes, not {declared}")
        return SpooledDelta(round_, manifest_bytes, manifest, meta, directory / "stream.bin")

    def spooled_rounds(self) -> list[int]:
        if not self._spool.is_dir():
            return []
        return sorted(
            int(m.group(1))
            for entry in self._spool.iterdir()
            if (m := _SPOOL_RE.fullmatch(entry.name)) is not None
        )

    def discard_spool(self, round_: int) -> None:
        """Drop a delta that will never be accepted (its round closed); keep the residual."""
        directory = self.spool_dir(round_)
        if directory.exists():
            shutil.rmtree(directory)
            fsync_dir(self._spool)

    def promote(self, round_: int) -> None:
        """The coordinator accepted the delta of ``round_``: record it, advance the residual.

        Idempotent, in an order that a crash at any step can finish later: the progress
        record first, then the residual (a rename), then the spool is removed.
        """
        uploaded = self.uploaded_round()
        if uploaded is None or uploaded < round_:
            body = {"format": FORMAT_VERSION, "uploaded_round": round_}
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.root / "progress.json", json.dumps(body).encode())
        residual = self.spool_dir(round_) / "residual.pt"
        if residual.exists():
            replace_durably(residual, self.feedback_path)
        self.discard_spool(round_)

    def uploaded_round(self) -> int | None:
        """The last round whose delta the coordinator accepted, if any;
        :class:`ProgressDamaged` when its record is unreadable."""
        try:
            data = _read_json(self.root / "progress.json")
        except StateError as exc:
            raise ProgressDamaged(str(exc)) from None
        if data is None:
            return None
        value = data.get("uploaded_round")
        if not isinstance(value, int) or isinstance(value, bool):
            raise ProgressDamaged(f"{self.root / 'progress.json'}: uploaded_round is {value!r}")
        return value

    def forget_progress(self) -> None:
        """Drop the progress record (a damaged one, before it is rebuilt)."""
        path = self.root / "progress.json"
        if path.exists():
            path.unlink()
            fsync_dir(self.root)

    def progress(self) -> tuple[ParamsVersion | None, int | None]:
        """The θ held and the last round delivered, as recorded."""
        return self.current_version(), self.uploaded_round()

    def discard(self) -> None:
        """Drop everything of the job (θ, residual, progress, spooled deltas).

        For a coordinator restored from an older backup: none of it belongs to the
        coordinator's history any more. Markers go first, so a crash midway leaves a
        state that reads as holding nothing rather than as holding a half-removed θ.
        """
        (self._params / "current.json").unlink(missing_ok=True)
        (self.root / "progress.json").unlink(missing_ok=True)
        if self.root.exists():
            shutil.rmtree(self.root)
            fsync_dir(self.root.parent)

    def recover(self) -> None:
        """Finish promotions a crash interrupted and drop spools of rounds already taken."""
        uploaded = self.uploaded_round()
        if uploaded is None:
            return
        for round_ in self.spooled_rounds():
            if round_ == uploaded:
                self.promote(round_)
            elif round_ < uploaded:
                self.discard_spool(round_)


class AgentState:
    """The agent's state directory: one :class:`JobDirectory` per job."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def job(self, job: str) -> JobDirectory:
        return JobDirectory(self.root, job)

    def prepare(self) -> None:
        """Create the state directory (owner-only: θ and residuals never leave the region)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)


def _load(path: Path) -> dict[str, Any]:
    try:
        body = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise StateError(f"{path} is missing") from None
    except Exception as exc:
        raise StateError(f"{path}: unreadable: {exc}") from None
    if not isinstance(body, dict):
        raise StateError(f"{path}: expected a mapping, found {type(body).__name__}")
    return body


def _file_identity(path: Path) -> list[int] | None:
    """Size, modification time (ns) and inode of ``path``: what changes when it is
    rewritten or replaced; None when it is missing."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _held_identity(path: Path) -> list[list[int] | None] | None:
    """:func:`_file_identity` of a held θ's chain file and of every file it names; None
    when the chain is unreadable."""
    try:
        chain = ThetaChain.load(path)
    except ThetaFileError:
        return None
    files = (path, chain.base, *(update.path for update in chain.updates))
    return [_file_identity(file) for file in files]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise StateError(f"{path}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise StateError(f"{path}: expected a JSON object")
    return data


def _second_name(source: Path, target: Path) -> None:
    """Give a worker's file a second name (it is never rewritten in place, so the link
    cannot change under the spool); a copy where the two lie on other devices."""
    try:
        os.link(source, target)
    except OSError:
        with source.open("rb") as src, AtomicFile(target, private=True) as dst:
            shutil.copyfileobj(src, dst)
