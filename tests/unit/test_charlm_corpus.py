"""The charlm corpus: file selection, validation split, and non-IID region groups."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from geofed.examples.charlm.corpus import (
    VALIDATION_MODULUS,
    Corpus,
    CorpusError,
    is_validation_file,
    load_corpus,
    scan_corpus,
    stable_hash,
    unit_of,
)
from tests.support.fake_stdlib import FAKE_UNITS, make_fake_stdlib


@pytest.fixture(scope="module")
def fake_corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return scan_corpus(make_fake_stdlib(tmp_path_factory.mktemp("stdlib")))


@pytest.fixture(scope="module")
def stdlib() -> Corpus:
    return load_corpus()


def test_stable_hash_is_pinned() -> None:
    # Must not depend on PYTHONHASHSEED: every process assigns files alike.
    assert stable_hash("val:json/decoder.py") == 13908291332959984561
    assert stable_hash("") == 1449310910991872227
    digest = hashlib.sha256(b"val:os.py").digest()
    assert stable_hash("val:os.py") == int.from_bytes(digest[:8], "little")


@pytest.mark.parametrize(
    ("relpath", "unit"),
    [("os.py", "os"), ("asyncio/events.py", "asyncio"), ("xml/dom/minidom.py", "xml")],
)
def test_unit_of(relpath: str, unit: str) -> None:
    assert unit_of(relpath) == unit


def test_fake_tree_selects_only_python_sources(fake_corpus: Corpus) -> None:
    files = [f for u in fake_corpus.units for f in u.files] + list(fake_corpus.validation_files)
    assert len(files) == 10 * 6 + 4
    assert all(f.endswith(".py") for f in files)
    assert not any(part in f for f in files for part in ("site-packages", "test", "__pycache__"))
    everything = b"".join(u.data for u in fake_corpus.units) + fake_corpus.validation
    assert b"Z" not in everything
    assert {u.name for u in fake_corpus.units} <= set(FAKE_UNITS)


def test_unit_data_is_its_files_in_order(fake_corpus: Corpus) -> None:
    for unit in fake_corpus.units:
        assert list(unit.files) == sorted(unit.files)
        expected = b"".join((fake_corpus.root / f).read_bytes() for f in unit.files)
        assert unit.data == expected
        assert set(unit.data) <= {ord(FAKE_UNITS[unit.name]), ord("\n")}


def test_validation_split_is_held_out(fake_corpus: Corpus) -> None:
    assert fake_corpus.validation_files, "the fake tree must hold at least one validation file"
    train_files = {f for u in fake_corpus.units for f in u.files}
    assert train_files.isdisjoint(fake_corpus.validation_files)
    assert all(is_validation_file(f) for f in fake_corpus.validation_files)
    assert not any(is_validation_file(f) for f in train_files)


def test_groups_partition_the_units(fake_corpus: Corpus) -> None:
    names = {u.name for u in fake_corpus.units}
    for num_groups in (1, 2, 3, 5, len(names)):
        groups = fake_corpus.assign_groups(num_groups)
        assert len(groups) == num_groups
        assert all(groups)
        flat = [n for g in groups for n in g]
        assert sorted(flat) == sorted(names)
        assert groups == fake_corpus.assign_groups(num_groups)


def test_group_data_holds_only_its_units(fake_corpus: Corpus) -> None:
    groups = fake_corpus.assign_groups(3)
    for index, members in enumerate(groups):
        letters = {ord(FAKE_UNITS[name]) for name in members} | {ord("\n")}
        data = fake_corpus.group_data(index, 3)
        assert set(data) == letters
        assert len(data) == sum(len(u.data) for u in fake_corpus.units if u.name in members)


def test_too_many_groups_is_refused(fake_corpus: Corpus) -> None:
    with pytest.raises(CorpusError, match=r"cannot split \d+ corpus units into 99 groups"):
        fake_corpus.assign_groups(99)
    with pytest.raises(CorpusError, match="group_index"):
        fake_corpus.group_data(3, 3)


def test_missing_or_empty_root_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="is not a directory"):
        scan_corpus(tmp_path / "absent")
    with pytest.raises(CorpusError, match="no training files"):
        scan_corpus(tmp_path)


def test_fingerprint_follows_content(tmp_path: Path) -> None:
    first = scan_corpus(make_fake_stdlib(tmp_path / "one"))
    second = scan_corpus(make_fake_stdlib(tmp_path / "two"))
    assert first.fingerprint == second.fingerprint
    (tmp_path / "two" / "pkga" / "part1.py").write_text("changed\n")
    assert scan_corpus(tmp_path / "two").fingerprint != first.fingerprint


def test_load_corpus_reads_once_per_process(tmp_path: Path) -> None:
    root = make_fake_stdlib(tmp_path)
    assert load_corpus(root) is load_corpus(root)


def test_stdlib_validation_never_overlaps_training(stdlib: Corpus) -> None:
    train_files = {f for u in stdlib.units for f in u.files}
    assert train_files.isdisjoint(stdlib.validation_files)
    fraction = len(stdlib.validation_files) / (len(train_files) + len(stdlib.validation_files))
    assert 0.5 / VALIDATION_MODULUS < fraction < 2.0 / VALIDATION_MODULUS
    assert len(stdlib.validation) > 100_000


def test_stdlib_excludes_tests_and_third_party(stdlib: Corpus) -> None:
    names = {u.name for u in stdlib.units}
    assert {"asyncio", "json", "os"} <= names
    assert not names & {"test", "site-packages"}
    all_files = [f for u in stdlib.units for f in u.files]
    assert not any("/tests/" in f or "/idle_test/" in f for f in all_files)


@pytest.mark.parametrize("num_regions", [2, 3, 8])
def test_stdlib_regions_are_balanced_and_disjoint(stdlib: Corpus, num_regions: int) -> None:
    groups = stdlib.assign_groups(num_regions)
    for a in range(num_regions):
        for b in range(a + 1, num_regions):
            assert set(groups[a]).isdisjoint(groups[b])
    sizes = [len(stdlib.group_data(i, num_regions)) for i in range(num_regions)]
    assert max(sizes) < 1.1 * min(sizes)
