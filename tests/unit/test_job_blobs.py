"""Each job's blobs in a store of its own: what one job deletes, another still reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordinator.storage.job_blobs import JobBlobStores
from coordinator.storage.working_state import ParamsStore, WorkingState
from geofed.blobstore import BlobNotFound, FsBlobStore


def test_identical_blobs_of_two_jobs_are_deleted_each_on_its_own(tmp_path: Path) -> None:
    stores = JobBlobStores(tmp_path)
    alpha, beta = stores.for_job("alpha"), stores.for_job("beta")
    digest = alpha.put(b"the same delta")
    assert beta.put(b"the same delta") == digest
    assert alpha.delete(digest)
    assert beta.get(digest) == b"the same delta"
    assert not alpha.exists(digest)
    with pytest.raises(BlobNotFound):
        alpha.get(digest)
    assert beta.read_path(digest).parent.parent == tmp_path / "blobs" / "jobs" / "beta"


def test_a_working_state_saved_over_leaves_another_jobs_identical_state(
    tmp_path: Path,
) -> None:
    """Two jobs from the same base model save the same θ_0; one moving on to θ_1 deletes
    its θ_0, and the other still loads its own (it did not, in one shared store)."""
    stores = JobBlobStores(tmp_path)
    theta = {"w": torch.arange(6, dtype=torch.float32)}
    momentum = {"w": torch.zeros(6)}
    alpha, beta = ParamsStore(stores.for_job("alpha")), ParamsStore(stores.for_job("beta"))
    initial = WorkingState.initial(theta, momentum)
    alpha_0, beta_0 = alpha.save(initial), beta.save(initial)
    assert alpha_0 == beta_0  # the same bytes, the same digests
    moved = WorkingState.initial({"w": theta["w"] + 1}, momentum)
    alpha_1 = alpha.save(WorkingState(1, moved.params, moved.params_hash, momentum, None))
    assert alpha.delete(alpha_0, keep=alpha_1) == 1  # θ_0 (the momentum is unchanged)
    assert torch.equal(beta.load(beta_0).params["w"], theta["w"])


def test_blobs_of_the_shared_store_are_read_and_never_deleted(tmp_path: Path) -> None:
    older = FsBlobStore(tmp_path / "blobs").put(b"saved before each job had a store")
    stores = JobBlobStores(tmp_path)
    assert stores.legacy_count() == 1
    alpha = stores.for_job("alpha")
    assert alpha.exists(older)
    assert alpha.get(older) == b"saved before each job had a store"
    assert alpha.size(older) == len(b"saved before each job had a store")
    with alpha.open(older) as reader:
        assert reader.read() == b"saved before each job had a store"
    assert alpha.read_path(older) == stores.legacy.path_of(older)
    assert not alpha.delete(older)  # another job may need it
    assert stores.legacy.exists(older)
    # Written again, a blob goes to the job's own store, which is read first and deleted.
    assert alpha.put(b"saved before each job had a store") == older
    assert alpha.read_path(older) == alpha.path_of(older) != stores.legacy.path_of(older)
    assert alpha.delete(older)
    assert stores.legacy.exists(older)
    assert alpha.exists(older)  # read from the shared store again


def test_the_jobs_stores_are_not_blobs_of_the_shared_one(tmp_path: Path) -> None:
    stores = JobBlobStores(tmp_path)
    stores.for_job("alpha").put(b"a job's own")
    assert stores.legacy_count() == 0
    assert stores.for_job("alpha") is stores.for_job("alpha")


@pytest.mark.parametrize("job", ["../escape", "a/b", "", "."])
def test_a_job_name_that_is_not_a_directory_name_is_refused(tmp_path: Path, job: str) -> None:
    with pytest.raises(ValueError, match="job"):
        JobBlobStores(tmp_path).for_job(job)
    assert not (tmp_path / "blobs" / "jobs").exists() or not any(
        (tmp_path / "blobs" / "jobs").iterdir()
    )


def test_a_job_adopts_the_shared_blobs_it_names_and_only_those(tmp_path: Path) -> None:
    legacy = FsBlobStore(tmp_path / "blobs")
    needed, other = legacy.put(b"a delta the job replays"), legacy.put(b"another job's")
    stores = JobBlobStores(tmp_path)
    alpha = stores.for_job("alpha")
    own = alpha.put(b"already the job's own")
    missing = "0" * 64
    assert alpha.adopt_legacy([needed, needed, own, missing]) == 1
    assert alpha.path_of(needed).is_file()
    assert not alpha.path_of(other).exists()
    assert not alpha.path_of(missing).exists()
    # A hard link: the shared store's copy stays, and removing it leaves the job's.
    assert alpha.path_of(needed).stat().st_ino == legacy.path_of(needed).stat().st_ino
    legacy.delete(needed)
    assert alpha.get(needed) == b"a delta the job replays"
    assert alpha.adopt_legacy([needed]) == 0
