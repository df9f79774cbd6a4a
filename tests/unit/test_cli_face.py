"""What the CLI says: arguments it cannot use are usage errors (exit 2) naming the argument,
and what it prints is for a person (no Python reprs)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from geofed_cli import main
from geofed_cli.export import shard_size
from geofed_cli.lineage import print_lineage


@pytest.mark.parametrize(
    "argv",
    [
        ["export", "charlm", "--round", "-1", "--out", "model.safetensors"],
        ["lineage", "charlm", "--round", "-1"],
        ["export", "charlm", "--round", "two", "--out", "model.safetensors"],
    ],
)
def test_a_version_below_zero_or_not_a_number_is_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "argument --round: " in capsys.readouterr().err


def test_lineage_prints_settings_as_a_person_reads_them() -> None:
    body = {
        "job": "charlm",
        "version": 3,
        "signed_by": "spiffe://acme/coordinator/main",
        "update_manifest": "ab" * 32,
        "lineage": {
            "round": 2,
            "codec": {"scheme": "int8", "block_size": 128, "stochastic_rounding": False},
            "training": {"lr_schedule": {"kind": "cosine", "warmup_steps": 10}, "extra": None},
            "aggregation": {"rule": "mean", "drop": []},
        },
    }
    out = io.StringIO()
    print_lineage(body, out)
    text = out.getvalue()
    assert "  codec: scheme int8, block_size 128, stochastic_rounding no\n" in text
    assert "  training: lr_schedule (kind cosine, warmup_steps 10), extra none\n" in text
    assert "  aggregation: rule mean, drop []\n" in text
    assert "{'" not in text


@pytest.mark.parametrize("size", ["big", "5 GX", "0", "-1MB", "1.5GB", ""])
def test_a_max_shard_size_that_is_not_a_size_is_a_usage_error(
    size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["export", "llm", "--format", "hf", "--out", "out", "--max-shard-size", size]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "argument --max-shard-size: " in capsys.readouterr().err


def test_sizes_read_as_bytes() -> None:
    assert shard_size("123") == 123
    assert shard_size("100KB") == 100_000
    assert shard_size("5GB") == 5 * 10**9
    assert shard_size("2GiB") == 2 * 2**30
    assert shard_size("64 mib") == 64 * 2**20


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-shard-size", "1GB"),
        ("--dtype", "bfloat16"),
        ("--hf-model", "models/llama"),
        ("--hf-tokenizer", "models/tokenizer"),
    ],
)
@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_the_hf_formats_flags_are_refused_for_the_other_formats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, fmt: str
) -> None:
    out = tmp_path / "model.safetensors"
    argv = ["export", "llm", "--out", str(out), "--format", fmt, flag, value, "--store", "x"]
    assert main(argv) == 2  # said, rather than ignored
    assert f"{flag} is for --format hf" in capsys.readouterr().err
    assert not out.exists()


def test_a_tokenizer_directory_without_a_tokenizer_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "export"
    argv = ["export", "llm", "--format", "hf", "--out", str(out), "--store", str(tmp_path)]
    argv += ["--hf-model", str(tmp_path), "--hf-tokenizer", str(tmp_path)]
    assert main(argv) == 2
    assert f"--hf-tokenizer {tmp_path}: no tokenizer.json" in capsys.readouterr().err
    assert not out.exists()
