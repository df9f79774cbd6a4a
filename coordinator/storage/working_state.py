"""The coordinator's working state of a job: θ_r, the outer optimizer state, the EF residual.

Each lives in a content-addressed blob (``torch.save`` bytes, loaded back with
``weights_only=True``, so the round trip is bit-exact and loading runs no pickled code).
The blobs are written first; the state store's pointers to them change only in the
transaction that marks the round published, so a crash in between leaves the previous
state in force and only orphaned blobs behind. Blocking: call it from a worker thread.

The blobs are not written every round (three copies of the model each time): a round
that does not save them moves only the ``version`` and ``params_hash`` pointers, and the
blobs stay those of the ``saved`` version (``saved_hash``: its θ's hash). A restarted
coordinator loads the saved state and replays the rounds after it from their kept deltas
(:mod:`coordinator.storage.replay`). Pointers written before ``saved`` existed name a
state saved at ``version`` itself.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import Tensor

from geofed.blobstore import BlobNotFound, BlobStore, BlobStoreError
from geofed.params import parameters_vector_hash

__all__ = [
    "POINTERS",
    "ParamsError",
    "ParamsStore",
    "Saved",
    "SavedPointers",
    "WorkingState",
    "advanced_pointers",
    "read_pointers",
]

#: Pointer names (per job) in the state store.
VERSION: Final = "version"
PARAMS: Final = "params"
PARAMS_HASH: Final = "params_hash"
OUTER_STATE: Final = "outer_state"
EF_RESIDUAL: Final = "ef_residual"
#: The version whose state the blobs hold, and its θ's hash (absent: ``version``'s).
SAVED: Final = "saved"
SAVED_HASH: Final = "saved_hash"
POINTERS: Final = (VERSION, PARAMS, PARAMS_HASH, OUTER_STATE, EF_RESIDUAL)
#: The pointers that name the blobs.
BLOB_POINTERS: Final = (PARAMS, OUTER_STATE, EF_RESIDUAL)


class ParamsError(Exception):
    """Working state cannot be saved or loaded (missing or damaged blob, bad pointers)."""


@dataclass(frozen=True, slots=True)
class Saved:
    """The version whose working state is in the blob store, and its θ's hash."""

    version: int
    params_hash: str


@dataclass(frozen=True)
class WorkingState:
    """θ_version of a job and what the next outer step needs.

    ``residual`` is None until the first update was published (no quantization error
    yet). A state's tensors are its owner's: the engine's next publication takes its
    outer step in them (:func:`coordinator.aggregation.outer_round.publication_step`,
    ``in_place``), after which the state no longer holds θ_version; whatever else reads
    them (an evaluation's copy) is done first. ``saved``
    is the newest version whose state is in the blob store (``version`` itself when
    this state was saved; None: not known, which only a state built outside the
    daemon has).
    """

    version: int
    params: dict[str, Tensor]
    params_hash: str
    optimizer_state: Mapping[str, Any]
    residual: dict[str, Tensor] | None
    saved: Saved | None = None

    def spent(self) -> WorkingState:
        """This state's version and hashes without its tensors: what is left of it once a
        publication that failed part way has taken its step in them (no ``params``: the
        engine rebuilds θ_version from storage before it uses them again)."""
        return WorkingState(self.version, {}, self.params_hash, {}, None, self.saved)

    @classmethod
    def initial(cls, params: dict[str, Tensor], optimizer_state: Mapping[str, Any]) -> WorkingState:
        params_hash = parameters_vector_hash(params)
        return cls(0, params, params_hash, optimizer_state, None, Saved(0, params_hash))


@dataclass(frozen=True, slots=True)
class SavedPointers:
    """What a job's pointers say: θ_version's hash, and the saved state."""

    version: int
    params_hash: str
    saved: Saved


def read_pointers(pointers: Mapping[str, str]) -> SavedPointers:
    """The versions and hashes the pointers name; :class:`ParamsError` when they do not."""
    missing = [name for name in POINTERS if name not in pointers]
    if missing:
        raise ParamsError(f"job state lacks pointers {missing}")
    try:
        version = int(pointers[VERSION])
        saved = int(pointers.get(SAVED, pointers[VERSION]))
    except ValueError:
        raise ParamsError(
            f"version pointers {pointers[VERSION]!r}, {pointers.get(SAVED)!r} are not integers"
        ) from None
    if not 0 <= saved <= version:
        raise ParamsError(f"saved version {saved} is not within 0..{version}")
    params_hash = pointers[PARAMS_HASH]
    if saved == version:
        return SavedPointers(version, params_hash, Saved(saved, params_hash))
    if not pointers.get(SAVED_HASH):
        raise ParamsError(f"the state saved at version {saved} has no recorded hash")
    return SavedPointers(version, params_hash, Saved(saved, pointers[SAVED_HASH]))


def advanced_pointers(version: int, params_hash: str, saved: Saved) -> dict[str, str]:
    """The pointer values of a round that moves the job to θ_version without saving its
    state: the blobs stay those of ``saved``."""
    return {
        VERSION: str(version),
        PARAMS_HASH: params_hash,
        SAVED: str(saved.version),
        SAVED_HASH: saved.params_hash,
    }


@dataclass(frozen=True)
class PendingSave:
    """A working state's blobs being stored (:meth:`ParamsStore.begin_save`)."""

    version: int
    blobs: Mapping[str, Future[str]]

    def pointers(self, params_hash: str) -> dict[str, str]:
        """Wait for every blob; the pointer values that name them (first error raised)."""
        digests = {name: future.result() for name, future in self.blobs.items()}
        return {
            VERSION: str(self.version),
            PARAMS: digests[PARAMS],
            PARAMS_HASH: params_hash,
            OUTER_STATE: digests[OUTER_STATE],
            EF_RESIDUAL: digests.get(EF_RESIDUAL, ""),
            SAVED: str(self.version),
            SAVED_HASH: params_hash,
        }


def _done(value: str) -> Future[str]:
    future: Future[str] = Future()
    future.set_result(value)
    return future


class ParamsStore:
    """Saves and loads :class:`WorkingState` as blobs plus pointer values."""

    def __init__(self, blobs: BlobStore) -> None:
        self._blobs = blobs

    def save(self, state: WorkingState) -> dict[str, str]:
        """Store the blobs of ``state``; return the pointer values that name them."""
        pending = self.begin_save(
            state.version, state.params, state.optimizer_state, state.residual, None
        )
        return pending.pointers(state.params_hash)

    def begin_save(
        self,
        version: int,
        params: Mapping[str, Tensor],
        optimizer_state: Mapping[str, Any],
        residual: Mapping[str, Tensor] | None,
        pool: Executor | None,
    ) -> PendingSave:
        """Start storing a state's blobs (θ, outer optimizer state, residual: one model's
        size each), side by side in ``pool`` when given; θ's hash is not needed yet."""
        values: dict[str, object] = {PARAMS: dict(params), OUTER_STATE: dict(optimizer_state)}
        if residual is not None:
            values[EF_RESIDUAL] = dict(residual)
        if pool is None:
            done = {name: self._put(value) for name, value in values.items()}
            return PendingSave(version, {name: _done(digest) for name, digest in done.items()})
        return PendingSave(
            version, {name: pool.submit(self._put, value) for name, value in values.items()}
        )

    def load(self, pointers: Mapping[str, str]) -> WorkingState:
        """Rebuild the saved state the pointers name (θ_saved, which is θ_version unless
        rounds after it were not saved: :func:`read_pointers`); check θ against its
        recorded hash."""
        saved = read_pointers(pointers).saved
        params = self._tensors(self._get(pointers[PARAMS]), "parameters")
        actual = parameters_vector_hash(params)
        if actual != saved.params_hash:
            raise ParamsError(
                f"parameters blob {pointers[PARAMS]} hashes to {actual}, not the recorded "
                f"{saved.params_hash}"
            )
        optimizer_state = self._get(pointers[OUTER_STATE])
        if not isinstance(optimizer_state, dict):
            raise ParamsError("outer optimizer state blob is not a mapping")
        residual = None
        if pointers[EF_RESIDUAL]:
            residual = self._tensors(self._get(pointers[EF_RESIDUAL]), "residual")
        return WorkingState(saved.version, params, actual, optimizer_state, residual, saved)

    def delete(self, pointers: Mapping[str, str], keep: Mapping[str, str]) -> int:
        """Remove the blobs ``pointers`` name that ``keep`` does not; return how many."""
        kept = {keep.get(name) for name in BLOB_POINTERS}
        removed = 0
        for name in BLOB_POINTERS:
            digest = pointers.get(name)
            if digest and digest not in kept and self._blobs.delete(digest):
                removed += 1
        return removed

    def _put(self, value: object) -> str:
        # Serialized straight into the store: no in-memory copy of a model-sized blob.
        return self._blobs.put_written(lambda file: torch.save(value, file))

    def _get(self, digest: str) -> object:
        try:
            data = self._blobs.get(digest)
        except BlobNotFound:
            raise ParamsError(f"working-state blob {digest} is missing") from None
        except BlobStoreError as exc:
            raise ParamsError(f"working-state blob {digest} is unusable: {exc}") from None
        try:
            loaded: object = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:  # torch raises many kinds on damaged pickles
            raise ParamsError(f"working-state blob {digest} does not load: {exc}") from exc
        return loaded

    @staticmethod
    def _tensors(value: object, what: str) -> dict[str, Tensor]:
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in value.items()
        ):
            raise ParamsError(f"{what} blob is not a mapping of names to tensors")
        return dict(value)
