"""Reaching θ_r for a round: apply the published update, or resync from the checkpoint.

:func:`verify_artifact` is the one gate every downloaded artifact passes before any of
its values is used (:mod:`geofed.artifact_check`, shared with ``geofed export``; here its
refusals are :class:`ArtifactRejected`). Then the parameters it reconstructs must hash to
the manifest's ``parameters_hash``.

:class:`Synchronizer` decides how to get there (protocol: "Round lifecycle", step 2):
nothing to do when the held θ already has the announced hash; the update when the held
θ is the version just before; a full resync otherwise, and whenever an update is
refused. θ lives in files: a snapshot is decoded piece by piece into a θ file
(:mod:`geofed.theta_file`), and an update, once verified, is kept in its file and chained
after the held θ (:mod:`geofed.theta_chain`: θ_{r+1} is the held chain's θ file plus the
updates after it, checked by hashing it a tensor at a time), or, every
``theta_file_every`` rounds, θ is written whole as a θ file again, so the agent never
holds θ in memory and writes it whole only now and then (and gives the buffers it
streamed through back to the system after each, :func:`geofed.heap.trim_heap`).
Verification and the tensor arithmetic run in a worker thread. A resync fetches up to
``download_window`` artifacts of the checkpoint's chain at once (agent config
``transfer.download_window``) and still verifies and applies them in order; each
artifact is one streamed GET that resumes with ``Range`` after a drop.

With :class:`~regional_agent.metrics.AgentMetrics` it counts the bytes downloaded (as
they arrive, failed downloads included), the float32 size of the tensors every verified
update or snapshot it applies carries (a streaming round's update carries only its
fragment, a snapshot all of θ), and each completed resync.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol

from torch import Tensor

from geofed import artifact_check
from geofed.api_paths import ApiPaths
from geofed.artifact_check import ArtifactRefused, VerifiedArtifact
from geofed.control import RoundAnnouncement
from geofed.heap import trim_heap
from geofed.pki import TrustBundle
from geofed.pki.bundle_source import BundleSource, current
from geofed.theta_chain import (
    ThetaChain,
    chain_update,
    held_chain,
    map_params,
    params_shapes,
)
from geofed.theta_file import ThetaFileError
from geofed.types import ArtifactKind
from regional_agent.metrics import AgentMetrics, MetricsError
from regional_agent.state import HeldTheta, ParamsVersion
from regional_agent.transfer.coordinator_client import (
    CoordinatorClient,
    CoordinatorError,
    HttpError,
)
from regional_agent.transfer.prefetch import Prefetch

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]
Params = dict[str, Tensor]


class SyncError(Exception):
    """θ_r could not be reached; the message says what failed."""


class ArtifactRejected(SyncError):
    """A downloaded update or snapshot failed verification; none of it was used."""


class ResyncFailed(SyncError):
    """The latest checkpoint does not reconstruct the announced θ_r."""


@dataclass(frozen=True)
class Synced:
    """The θ reached (its chain's file, :mod:`geofed.theta_chain`), its version, and how
    (``held``, ``update`` or ``resync``)."""

    path: Path
    version: ParamsVersion
    method: Literal["held", "update", "resync"]
    refused: str | None = None
    """Why an update was refused before the resync, if one was."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """θ's tensors' names (in θ's order) and shapes, from the files' headers."""
        return params_shapes(self.path)

    def tensors(self) -> Mapping[str, Tensor]:
        """θ's tensors, mapped from its θ file or read from its chain as they are used."""
        return map_params(self.path)


def _utc_now() -> datetime:
    return datetime.now(UTC)


def verify_artifact(
    data: bytes | bytearray | memoryview,
    bundle: TrustBundle,
    *,
    kind: ArtifactKind,
    job: str,
    round_: int,
    now: datetime,
    max_decoded_bytes: int | None = None,
    decode_now: bool = True,
) -> VerifiedArtifact:
    """:func:`geofed.artifact_check.verify_artifact`; raise :class:`ArtifactRejected`."""
    try:
        return artifact_check.verify_artifact(
            data,
            bundle,
            kind=kind,
            job=job,
            round_=round_,
            now=now,
            max_decoded_bytes=max_decoded_bytes,
            decode_now=decode_now,
        )
    except ArtifactRefused as exc:
        raise ArtifactRejected(str(exc)) from None


class Synchronizer:
    """Brings a region's θ to the one a round announces."""

    def __init__(
        self,
        client: CoordinatorClient,
        bundle: BundleSource,
        *,
        clock: Clock = _utc_now,
        metrics: AgentMetrics | None = None,
        download_window: int = 1,
        theta_file_every: int = 1,
    ) -> None:
        if download_window < 1:
            raise ValueError(f"download window must be >= 1, got {download_window}")
        if theta_file_every < 1:
            raise ValueError(f"theta_file_every must be >= 1, got {theta_file_every}")
        self._download_window = download_window
        self._theta_file_every = theta_file_every
        self._client = client
        self._bundle = bundle
        self._clock = clock
        self._metrics = metrics

    async def sync(
        self, announcement: RoundAnnouncement, held: HeldTheta | None, places: ThetaPlaces
    ) -> Synced:
        """θ_r for ``announcement``, from ``held`` when it can be, as a θ file.

        A θ reached by an update or a resync is described at ``places.held_path(round)``
        (a chain, :mod:`geofed.theta_chain`; never whole in memory), each artifact
        downloaded to ``places.download_path`` first, then kept in
        ``places.update_path(round)`` for a chain or removed once used; a held θ stays
        where it is.
        """
        target = ParamsVersion(announcement.base_round, announcement.base_hash)
        if held is not None and held.version.hash == target.hash:
            return Synced(held.path, target, "held")
        refused: str | None = None
        url = announcement.update_url
        if held is not None and url is not None and held.version.round == target.round - 1:
            try:
                version, counted = await self._update(announcement, url, held, places)
            except (ArtifactRejected, HttpError) as exc:
                refused = str(exc)
                log.warning("refused the update to θ_%d (%s); resyncing", target.round, exc)
            else:
                if version == target:
                    self._applied(counted)
                    return Synced(places.held_path(version.round), version, "update")
                refused = f"update gives θ hash {version.hash}, announced {target.hash}"
                log.warning("%s; resyncing", refused)
        version = await self.resync(announcement.job, target, places)
        return Synced(places.held_path(version.round), version, "resync", refused)

    async def _update(
        self, announcement: RoundAnnouncement, url: str, held: HeldTheta, places: ThetaPlaces
    ) -> tuple[ParamsVersion, Counted]:
        """θ after the announced update (written in ``places``), and what the update counts for."""
        job, round_ = announcement.job, held.version.round
        bundle = places.download_path(f"update-{round_}.bundle")
        try:
            await self._download(url, f"update {job}/{round_}", ArtifactKind.GLOBAL_UPDATE, bundle)

            def verify_and_apply() -> tuple[ParamsVersion, Counted]:
                update = self._verified_update(bundle, job, round_, held.path)
                digest = update.manifest_digest
                if announcement.update_digest not in (None, digest):
                    raise ArtifactRejected(
                        f"update {job}/{round_}: manifest digest {digest}, "
                        f"the announcement says {announcement.update_digest}"
                    )
                try:
                    return self._applied_to_file(update, held.path, held.version, places)
                finally:
                    trim_heap()

            return await asyncio.to_thread(verify_and_apply)
        finally:
            await asyncio.to_thread(bundle.unlink, missing_ok=True)

    async def coordinator_version(self, job: str) -> ParamsVersion | None:
        """The θ version the coordinator holds now for ``job`` (None before it has any)."""
        answer = (await self._client.request("GET", ApiPaths.job(job))).json()
        round_, hash_ = answer.get("round"), answer.get("params_hash")
        if hash_ is None:
            return None
        if not isinstance(round_, int) or isinstance(round_, bool) or not isinstance(hash_, str):
            raise CoordinatorError(f"job {job}: malformed status (round {round_!r})")
        return ParamsVersion(round_, hash_)

    async def delivered(self, job: str, round_: int) -> frozenset[str] | None:
        """The regions whose delta of ``round_`` the coordinator holds, if ``round_`` is its
        current round (None when it is another, or none)."""
        answer = (await self._client.request("GET", ApiPaths.job(job))).json()
        current = answer.get("current")
        if not isinstance(current, dict) or current.get("round") != round_:
            return None
        regions = current.get("delivered")
        if not isinstance(regions, list) or not all(isinstance(r, str) for r in regions):
            raise CoordinatorError(f"job {job}: malformed status (delivered {regions!r})")
        return frozenset(regions)

    async def resync(self, job: str, target: ParamsVersion, places: ThetaPlaces) -> ParamsVersion:
        """θ of ``target`` from the latest checkpoint, its snapshot then its updates, each
        θ on the way described at ``places.held_path(round)``."""
        answer = await self._client.request("GET", ApiPaths.latest_checkpoint(job))
        snapshot, updates = _chain(answer.json(), job, target.round)
        applied: list[Counted] = []  # counted once the chain reaches θ_r
        # Up to download_window artifacts of the chain travel at once; each is still
        # verified and applied in the chain's order, as it would be one at a time.
        bundles = [places.download_path(f"snapshot-{snapshot.round}.bundle")] + [
            places.download_path(f"update-{part.round}.bundle") for part in updates
        ]
        fetches = [
            self._fetch(
                snapshot.url,
                f"snapshot {job}/{snapshot.round}",
                ArtifactKind.GLOBAL_CHECKPOINT,
                bundles[0],
            )
        ] + [
            self._fetch(part.url, f"update {job}/{part.round}", ArtifactKind.GLOBAL_UPDATE, bundle)
            for part, bundle in zip(updates, bundles[1:], strict=True)
        ]
        try:
            async with Prefetch(fetches, self._download_window) as downloads:
                version, counted = await asyncio.to_thread(
                    self._verify_snapshot, await downloads.next(), job, snapshot, places
                )
                applied.append(counted)
                for part in updates:
                    bundle = await downloads.next()
                    version, counted = await asyncio.to_thread(
                        self._verify_and_apply, bundle, job, part, version, places
                    )
                    applied.append(counted)
        except ArtifactRejected as exc:
            raise ResyncFailed(f"resync of {job} to θ_{target.round}: {exc}") from exc
        finally:
            await asyncio.to_thread(_remove, bundles)
        if version != target:
            raise ResyncFailed(
                f"resync of {job}: the checkpoint gives θ_{version.round} with hash "
                f"{version.hash}, the round announced θ_{target.round} with hash {target.hash}"
            )
        for counted in applied:
            self._applied(counted)
        if self._metrics is not None:
            self._metrics.resynced(job)
        return version

    def _fetch(
        self, url: str, what: str, kind: ArtifactKind, target: Path
    ) -> Callable[[], Awaitable[Path]]:
        def fetch() -> Awaitable[Path]:
            return self._download(url, what, kind, target)

        return fetch

    async def _download(self, url: str, what: str, kind: ArtifactKind, target: Path) -> Path:
        await self._client.download_to(url, target, what=what, on_bytes=self._counter(kind))
        return target

    def _counter(self, kind: ArtifactKind) -> Callable[[int], None] | None:
        metrics = self._metrics
        if metrics is None:
            return None
        return lambda count: metrics.downloaded(kind, count)

    def _applied(self, counted: Counted) -> None:
        if self._metrics is None:
            return
        try:
            self._metrics.download_applied(counted.scheme, counted.fp32_bytes)
        except MetricsError as exc:  # a scheme the catalogue lacks: θ is fine, the count not
            log.warning("applied download not counted: %s", exc)

    def _verified_update(
        self, bundle: Path, job: str, round_: int, theta: Path
    ) -> VerifiedArtifact:
        """The update of ``round_`` downloaded to ``bundle``, verified, its frames left in the
        file to be decoded into θ's (no larger than θ when decoded)."""
        try:
            size = 4 * sum(math.prod(shape) for shape in params_shapes(theta).values())
        except ThetaFileError as exc:
            raise ArtifactRejected(f"update {job}/{round_}: the held {exc}") from None
        return self._verified(bundle, ArtifactKind.GLOBAL_UPDATE, job, round_, size)

    def _verified(
        self, bundle: Path, kind: ArtifactKind, job: str, round_: int, limit: int | None
    ) -> VerifiedArtifact:
        try:
            return artifact_check.verify_artifact_file(
                bundle,
                current(self._bundle),
                kind=kind,
                job=job,
                round_=round_,
                now=self._clock(),
                max_decoded_bytes=limit,
            )
        except ArtifactRefused as exc:
            raise ArtifactRejected(str(exc)) from None

    def _applied_to_file(
        self, update: VerifiedArtifact, theta: Path, version: ParamsVersion, places: ThetaPlaces
    ) -> tuple[ParamsVersion, Counted]:
        counted = Counted.of(update)
        round_ = version.round
        try:
            held = held_chain(theta, round_)
            whole = len(held.updates) + 1 >= self._theta_file_every
            chain, found = chain_update(
                held,
                version.hash,
                update,
                keep_at=places.update_path(round_),
                whole_at=places.params_path(round_ + 1) if whole else None,
            )
            chain.save(places.held_path(round_ + 1))
        except (ArtifactRefused, ThetaFileError) as exc:
            raise ArtifactRejected(str(exc)) from None
        return ParamsVersion(round_ + 1, found), counted

    def _verify_snapshot(
        self, bundle: Path, job: str, part: ListedPart, places: ThetaPlaces
    ) -> tuple[ParamsVersion, Counted]:
        snapshot = self._verified(bundle, ArtifactKind.GLOBAL_CHECKPOINT, job, part.round, None)
        part.check_digest(snapshot)
        try:
            found = artifact_check.snapshot_to_file(places.params_path(part.round), snapshot)
            ThetaChain(places.params_path(part.round), part.round).save(
                places.held_path(part.round)
            )
        except (ArtifactRefused, ThetaFileError) as exc:
            raise ArtifactRejected(str(exc)) from None
        finally:
            trim_heap()
        return ParamsVersion(part.round, found), Counted.of(snapshot)

    def _verify_and_apply(
        self,
        bundle: Path,
        job: str,
        part: ListedPart,
        version: ParamsVersion,
        places: ThetaPlaces,
    ) -> tuple[ParamsVersion, Counted]:
        theta = places.held_path(version.round)
        update = self._verified_update(bundle, job, part.round, theta)
        part.check_digest(update)
        try:
            return self._applied_to_file(update, theta, version, places)
        finally:
            trim_heap()


def _remove(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


class ThetaPlaces(Protocol):
    """Where a job's θ files, chains, kept updates and downloads go (the agent's
    :class:`~regional_agent.state.JobDirectory`)."""

    def params_path(self, round_: int) -> Path: ...

    def held_path(self, round_: int) -> Path: ...

    def update_path(self, round_: int) -> Path: ...

    def download_path(self, name: str) -> Path: ...


@dataclass(frozen=True, slots=True)
class Counted:
    """What an applied download stands for: its codec scheme and the float32 size of the
    tensors it carries (only those it names, so a streaming update counts its fragment)."""

    scheme: str
    fp32_bytes: int

    @classmethod
    def of(cls, artifact: VerifiedArtifact) -> Counted:
        declared = artifact.manifest.tensors  # decoded or not: what the stream carries
        return cls(artifact.manifest.codec.scheme, 4 * sum(math.prod(t.shape) for t in declared))


@dataclass(frozen=True, slots=True)
class ListedPart:
    """One artifact of a checkpoint chain as ``checkpoints/latest`` lists it."""

    round: int
    url: str
    manifest_digest: str | None

    def check_digest(self, artifact: VerifiedArtifact) -> None:
        if self.manifest_digest is not None and artifact.manifest_digest != self.manifest_digest:
            raise ArtifactRejected(
                f"{artifact.manifest.kind.value} {artifact.manifest.job}/{self.round}: manifest "
                f"digest {artifact.manifest_digest}, the checkpoint lists {self.manifest_digest}"
            )

    @classmethod
    def parse(cls, entry: Any) -> ListedPart:
        digest = entry.get("manifest_digest")
        return cls(int(entry["round"]), str(entry["url"]), None if digest is None else str(digest))


def _chain(info: Mapping[str, Any], job: str, target: int) -> tuple[ListedPart, list[ListedPart]]:
    """The snapshot and the updates after it up to θ_target (``checkpoints/latest``)."""
    try:
        snapshot = ListedPart.parse(info["snapshot"])
        updates = sorted(
            (ListedPart.parse(entry) for entry in info.get("updates", [])),
            key=lambda part: part.round,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ResyncFailed(f"checkpoint of {job}: malformed answer ({exc!r})") from None
    if snapshot.round > target:
        raise ResyncFailed(
            f"checkpoint of {job} starts at θ_{snapshot.round}, after the announced θ_{target}"
        )
    needed = [part for part in updates if snapshot.round <= part.round < target]
    if [part.round for part in needed] != list(range(snapshot.round, target)):
        have = [part.round for part in updates]
        raise ResyncFailed(
            f"checkpoint of {job}: updates {have} after snapshot θ_{snapshot.round} do not "
            f"reach θ_{target}"
        )
    return snapshot, needed
