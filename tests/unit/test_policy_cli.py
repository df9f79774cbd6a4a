"""``geofed policy check|explain|admit`` run in-process through the real CLI entry point."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from geofed.exit_codes import ExitCode
from geofed_cli import main

POLICY_DIR = str(Path(__file__).resolve().parents[2] / "configs" / "policies")

DEMO_JOB = """\
coordinator_jurisdiction: EU
regions:
  eu-west: [eu-support-chats]
  us-east: [us-public-domain-books]
  ap-south: [in-indic-wikipedia]
checkpoint_storage:
  - name: {storage}
"""


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    code = main(["policy", *argv])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def test_check_example_policies_passes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "check", "--strict", POLICY_DIR)
    assert (code, out) == (0, ["ok: 3 policies"])


def test_check_reports_every_error_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("region: eu-west\njurisdiction: EU\ncolour: blue\n", encoding="utf-8")
    clash = tmp_path / "clash.yaml"
    clash.write_text("region: eu-west\njurisdiction: EU\n", encoding="utf-8")
    code, out, _ = _run(capsys, "check", str(bad), POLICY_DIR)
    assert code == 1
    assert out[0].startswith(f"{bad}:3: colour: unknown key")
    assert out[-1] == "failed: 1 error(s)"
    # valid on its own, but claims a region another file defines
    code, out, _ = _run(capsys, "check", POLICY_DIR, str(clash))
    assert code == 1
    assert out[0] == f"{clash}:1: region: region eu-west is already defined at " + (
        f"{POLICY_DIR}/eu-west.yaml:11"
    )


def test_check_warnings_pass_unless_strict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "region: solo\njurisdiction: EU\nexports:\n  logs:\n"
        "    - {effect: allow, to: ['storage:nowhere']}\n",
        encoding="utf-8",
    )
    code, out, _ = _run(capsys, "check", str(path))
    assert code == 0
    assert out[0].startswith(f"{path}:5: exports.logs[0].to[0]: warning: ")
    assert out[-1] == "ok: 1 policies"
    code, out, _ = _run(capsys, "check", "--strict", str(path))
    assert code == 1
    assert out[-1] == "failed: 1 warning(s) with --strict"


@pytest.mark.parametrize(
    ("argv", "code", "first", "rule"),
    [
        (
            ["--kind", "global_checkpoint", "--source", "coordinator",
             "--destination", "storage:us-ckpt", "--provenance", "us-east"],
            0, "allow", "us-east:exports.global_checkpoint[0]",
        ),
        (
            ["--kind", "global_checkpoint", "--source", "coordinator",
             "--destination", "storage:us-ckpt", "--provenance", "us-east,eu-west"],
            1, "deny", "eu-west:exports.global_checkpoint[1]",
        ),
        (
            ["--kind", "model_delta", "--source", "region:ap-south",
             "--destination", "coordinator"],
            0, "allow", "ap-south:exports.model_delta[0]",
        ),
        (
            ["--kind", "logs", "--source", "region:ap-south", "--destination", "coordinator",
             "--coordinator-jurisdiction", "US"],
            1, "deny", "ap-south:exports.logs[default]",
        ),
        (
            ["--kind", "raw_data", "--source", "region:eu-west", "--destination", "region:us-east",
             "--provenance", "eu-west/eu-support-chats"],
            1, "deny", "eu-west:exports.raw_data[1]",
        ),
    ],
)  # fmt: skip
def test_explain_prints_decision_and_exits_with_it(
    capsys: pytest.CaptureFixture[str], argv: list[str], code: int, first: str, rule: str
) -> None:
    got, out, err = _run(capsys, "explain", "--policies", POLICY_DIR, *argv)
    assert (got, out[0]) == (code, first), err
    assert out[1].startswith(f"rule: {rule} ({POLICY_DIR}/")
    assert out[2].startswith("reason: ")
    assert "rules consulted:" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--source", "region:mars", "--destination", "coordinator"], "region mars"),
        (["--source", "coordinator", "--destination", "region:eu-west"], "--provenance"),
        (["--source", "bucket:x", "--destination", "coordinator"], "invalid endpoint"),
        (["--source", "region:eu-west", "--destination", "coordinator", "--provenance", "EU"], ""),
        (
            ["--source", "region:eu-west", "--destination", "coordinator",
             "--coordinator-jurisdiction", "europe"],
            "invalid jurisdiction",
        ),
    ],
)  # fmt: skip
def test_explain_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = _run(capsys, "explain", "--policies", POLICY_DIR, "--kind", "metrics", *argv)
    assert (code, out) == (2, [])
    assert err.startswith("error: ")
    assert message in err


def test_explain_with_broken_policies_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x.yaml").write_text("region: x\n", encoding="utf-8")
    code, out, err = _run(
        capsys, "explain", "--policies", str(tmp_path), "--kind", "metrics",
        "--source", "region:x", "--destination", "coordinator",
    )  # fmt: skip
    assert (code, out) == (2, [])
    assert f"{tmp_path / 'x.yaml'}:1: jurisdiction: missing required key" in err


def test_explain_unknown_kind_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["policy", "explain", "--policies", POLICY_DIR, "--kind", "weights",
              "--source", "region:eu-west", "--destination", "coordinator"])  # fmt: skip
    assert caught.value.code == 2
    assert "invalid choice: 'weights'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("storage", "code", "first", "last"),
    [
        ("eu-ckpt", 0, "admit", "checks passed: 13"),
        ("us-ckpt", 1, "deny", "checkpoint storage allowed: (none)"),
    ],
)
def test_admit_demo_job(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    storage: str,
    code: int,
    first: str,
    last: str,
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(DEMO_JOB.format(storage=storage), encoding="utf-8")
    got, out, _ = _run(capsys, "admit", "--policies", POLICY_DIR, "--job", str(job))
    assert (got, out[0], out[-1]) == (code, first, last)
    if code:
        assert any("eu-west:exports.global_checkpoint[1]" in line for line in out)
        assert any("ap-south:exports.global_checkpoint[1]" in line for line in out)
    else:
        assert out[1] == "checkpoint storage: eu-ckpt"


def test_admit_placement_errors_name_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(
        "coordinator_jurisdiction: EU\nregions:\n  eu-west: []\n"
        "checkpoint_storage:\n  - name: unknown-store\n  - {name: x, colour: red}\n",
        encoding="utf-8",
    )
    code, out, err = _run(capsys, "admit", "--policies", POLICY_DIR, "--job", str(job))
    assert (code, out) == (2, [])
    assert f"{job}:6: checkpoint_storage[1].colour: unknown key" in err
    job.write_text(
        "coordinator_jurisdiction: EU\nregions:\n  eu-west: []\n"
        "checkpoint_storage:\n  - name: unknown-store\n",
        encoding="utf-8",
    )
    code, out, err = _run(capsys, "admit", "--policies", POLICY_DIR, "--job", str(job))
    assert (code, out) == (2, [])
    assert err.splitlines() == [
        f"{job}:5: checkpoint_storage[0].name: no loaded policy declares storage location "
        "unknown-store; give its jurisdiction",
        f"{job}:3: regions.eu-west: region eu-west is assigned no datasets",
    ]


#: A policy nested far too deep, and the line its error names.
_DEEP = {
    "flow": ("region: deep\njurisdiction: EU\nexports: " + "[" * 100_000 + "]" * 100_000, 3),
    "block": (
        "region: deep\njurisdiction: EU\nexports:\n"
        + "".join("  " * (level + 1) + "- \n" for level in range(200)),
        67,  # the first item past the 64 levels
    ),
}


@pytest.mark.parametrize("shape", sorted(_DEEP))
def test_deeply_nested_policies_are_refused_with_a_line_and_the_documented_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shape: str
) -> None:
    policies = tmp_path / "policies"
    shutil.copytree(POLICY_DIR, policies)
    deep = policies / "deep.yaml"
    text, line = _DEEP[shape]
    deep.write_text(text, encoding="utf-8")
    code, out, err = _run(capsys, "check", str(policies))
    assert code == 1  # check: 1 on any error
    assert out[0].startswith(f"{deep}:{line}: (syntax): ")
    assert "Traceback" not in err
    code, out, err = _run(
        capsys, "explain", "--policies", str(policies), "--kind", "metrics",
        "--source", "region:eu-west", "--destination", "coordinator",
    )  # fmt: skip
    assert (code, out) == (2, [])  # explain: 2 on an error, never 1 (deny)
    assert f"{deep}:{line}: (syntax): " in err
    assert "Traceback" not in err
    # The coordinator refuses to start with a configuration error (exit 2, not restarted).
    config = tmp_path / "coordinator.yaml"
    example = (Path(POLICY_DIR).parent / "coordinator.yaml").read_text(encoding="utf-8")
    config.write_text(example.replace("policies_dir: policies", f"policies_dir: {policies}"))
    assert main(["coordinator", "--config", str(config)]) == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert f"policies_dir: {deep}:{line}: (syntax): " in err
    assert "Traceback" not in err
