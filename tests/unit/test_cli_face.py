"""What the CLI says: arguments it cannot use are usage errors (exit 2) naming the argument,
and what it prints is for a person (no Python reprs)."""

from __future__ import annotations

import io

import pytest

from geofed_cli import main
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
