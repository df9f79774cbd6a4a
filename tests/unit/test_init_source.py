"""init_from: the spec's source of θ_0, read and verified from export files (the job
source is exercised against a real coordinator in tests/integration/test_export.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from coordinator.jobs.init_source import (
    InitError,
    InitialState,
    check_shapes,
    file_source,
    load_initial,
)
from coordinator.jobs.spec import InitFrom, JobSpecError, parse_job_spec, parse_stored_spec
from geofed.export import safetensors_bytes, torch_checkpoint
from geofed.params import parameters_vector_hash
from geofed.pki import TrustBundle
from tests.support.pki import make_federation

PROVENANCE = [{"region": "eu-west", "jurisdiction": "EU", "datasets": ["eu-support-chats"]}]
SPEC = """\
job: tiny
task: {spec: "geofed.examples.charlm:CharLMTask"}
regions: {eu-west: [eu-support-chats]}
rounds: 2
inner_steps: 1
checkpoint_storage: [eu-ckpt]
"""


def params() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {"w": torch.randn(4, 3, generator=generator), "b": torch.randn(3, generator=generator)}


def metadata(theta: dict[str, torch.Tensor]) -> dict[str, str]:
    return {"parameters_hash": parameters_vector_hash(theta), "provenance": json.dumps(PROVENANCE)}


@pytest.fixture
def trust(tmp_path: Path) -> TrustBundle:
    return make_federation(tmp_path / "pki").bundle()


def load(source: InitFrom, imports: list[Path], trust: TrustBundle) -> InitialState:
    return load_initial(
        source, job_location=None, job_version=None, import_dirs=imports, trust=trust
    )


def test_an_export_file_gives_theta_and_what_it_derives_from(
    tmp_path: Path, trust: TrustBundle
) -> None:
    theta = params()
    exported = tmp_path / "imports" / "model.safetensors"
    exported.parent.mkdir()
    exported.write_bytes(safetensors_bytes(theta, metadata(theta)))
    state = load(InitFrom(path=str(exported)), [tmp_path / "imports"], trust)
    assert state.params_hash == parameters_vector_hash(theta)
    assert all(torch.equal(state.params[k], theta[k]) for k in theta)
    assert state.provenance == {"eu-west": ("eu-support-chats",)}
    buffer = io.BytesIO()
    torch.save(torch_checkpoint(theta, metadata(theta)), buffer)
    as_torch = tmp_path / "imports" / "model.pt"
    as_torch.write_bytes(buffer.getvalue())
    assert load(InitFrom(path=str(as_torch)), [tmp_path / "imports"], trust).params_hash == (
        state.params_hash
    )
    check_shapes(state, {"w": (4, 3), "b": (3,)})
    with pytest.raises(InitError, match=r"lacks \['extra'\].*\['w'\] differ in shape"):
        check_shapes(state, {"w": (3, 4), "b": (3,), "extra": (1,)})
    expected = InitFrom(path=str(exported), params_hash="0" * 64)
    with pytest.raises(InitError, match="not the 0000"):
        load(expected, [tmp_path / "imports"], trust)


def test_a_changed_or_foreign_file_is_refused(tmp_path: Path, trust: TrustBundle) -> None:
    imports = tmp_path / "imports"
    imports.mkdir()
    theta = params()
    changed = dict(theta, w=theta["w"] + 1)
    (imports / "changed.safetensors").write_bytes(safetensors_bytes(changed, metadata(theta)))
    with pytest.raises(InitError, match="it was changed"):
        load(InitFrom(path=str(imports / "changed.safetensors")), [imports], trust)
    (imports / "plain.safetensors").write_bytes(safetensors_bytes(theta, {}))
    with pytest.raises(InitError, match="records no parameters hash"):
        load(InitFrom(path=str(imports / "plain.safetensors")), [imports], trust)
    (imports / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InitError, match="cannot read it"):
        load(InitFrom(path=str(imports / "junk.safetensors")), [imports], trust)


def test_only_files_under_the_import_dirs_are_read(tmp_path: Path) -> None:
    (tmp_path / "imports").mkdir()
    outside = tmp_path / "secret.safetensors"
    with pytest.raises(InitError, match="imports no files; list the directory in its config"):
        file_source(str(outside), [])
    with pytest.raises(InitError, match="is not under the config's import_dirs"):
        file_source(str(outside), [tmp_path / "imports"])
    sneaky = tmp_path / "imports" / ".." / "secret.safetensors"
    with pytest.raises(InitError, match="is not under"):
        file_source(str(sneaky), [tmp_path / "imports"])
    (tmp_path / "imports" / "link").symlink_to(outside)
    with pytest.raises(InitError, match="is not under"):
        file_source(str(tmp_path / "imports" / "link"), [tmp_path / "imports"])
    inside = tmp_path / "imports" / "m.safetensors"
    assert file_source(str(inside), [tmp_path / "imports"]) == inside.resolve()


def test_the_spec_names_one_source_and_never_its_recorded_provenance() -> None:
    spec = parse_job_spec(SPEC + "init_from: {job: base, round: 3}\n", "job.yaml")
    assert spec.init_from == InitFrom(job="base", round=3)
    for bad, message in [
        ("init_from: {job: base, path: /x}", "either a job"),
        ("init_from: {path: /x, round: 2}", "round goes with init_from.job"),
        ("init_from: {job: base, provenance: {eu-west: [a]}}", "recorded by the coordinator"),
        ("init_from: {job: base, location: eu-ckpt}", "recorded by the coordinator"),
    ]:
        with pytest.raises(JobSpecError, match=message):
            parse_job_spec(SPEC + bad + "\n", "job.yaml")
    recorded = spec.model_copy(
        update={
            "init_from": InitFrom(job="base", round=3, provenance={"eu-west": ("a",)}, location="x")
        }
    )
    assert parse_stored_spec(json.loads(json.dumps(recorded.to_json()))) == recorded


def test_a_hugging_face_export_directory_is_a_source(tmp_path: Path, trust: TrustBundle) -> None:
    from geofed.params import federated_state
    from geofed.task import load_task
    from geofed.tasks.hf_export import write_hf_export
    from tests.support.hf_models import save_model

    model_dir = save_model(tmp_path / "model", "qwen2")
    task = load_task("geofed.tasks.hf:CausalLMTask", {"model": str(model_dir)})
    theta = federated_state(task.build_model(seed=0))
    write_hf_export(
        tmp_path / "imports" / "qwen",
        theta,
        model_dir=model_dir,
        tokenizer_dir=None,
        metadata={**metadata(theta), "job": "base"},
        params_hash=parameters_vector_hash(theta),
    )
    state = load(InitFrom(path=str(tmp_path / "imports" / "qwen")), [tmp_path / "imports"], trust)
    assert state.params_hash == parameters_vector_hash(theta)
    assert state.provenance == {"eu-west": ("eu-support-chats",)}
    check_shapes(state, {name: tuple(t.shape) for name, t in theta.items()})
    (tmp_path / "imports" / "plain").mkdir()
    with pytest.raises(InitError, match=r"no geofed_export\.json: not a geofed export"):
        load(InitFrom(path=str(tmp_path / "imports" / "plain")), [tmp_path / "imports"], trust)
