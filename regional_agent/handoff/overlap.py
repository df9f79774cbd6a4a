"""The one-step delayed outer update (``overlap: delayed``): its math and its decisions.

Serial rounds train round r from θ_r and form Δ_r against θ_r. Under ``delayed`` a region
hands in round r's result and at once trains round r+1 from its own parameters
y_r = θ_r + p_r, keeping a snapshot S = y_r. When θ_{r+1} arrives it is folded in at a
step boundary::

    y ← θ_{r+1} + (y - S)

so y = θ_{r+1} + p_{r+1} afterwards, p_{r+1} being the progress of round r+1 so far, and
the round's delta is formed against θ_{r+1} exactly as in serial mode. (It is the same as
``y ← y + (θ_{r+1} - S)``; the first form is what the workers compute, since they load θ
into the model, in place, between the two halves.) Tensor by tensor: under FSDP each rank
corrects its own shard.

``overlap: streaming`` (Streaming DiLoCo) is the same schedule, with round r synchronizing
only fragment r mod F of the model (:func:`round_names`): θ_{r+1} differs from θ_r in
that fragment alone, so the fold touches only its tensors (the speculative instruction's
``fold``, the snapshot S holds only them)::

    y[n] ← θ_{r+1}[n] + (y[n] - S[n])    for n in round r's fragment

and every other tensor keeps its local progress until its own fragment's round. A round
that is not speculative (round 0, after a resync, a restart, a cancelled speculation)
loads θ_r whole, so it loses the progress of the fragments not yet synchronized.

Nothing here does I/O: the workers (:mod:`regional_agent.worker.delayed_round`) and the agent
(:mod:`regional_agent.rounds.overlap_pipeline`) call these functions and act on their answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from geofed.fragments import FragmentPlan, fragment_plan
from geofed.params import shapes_of
from regional_agent.handoff.messages import RoundInstruction

#: The overlap modes whose regions train the next round ahead of its θ.
SPECULATIVE = ("delayed", "streaming")


def select(
    params: Mapping[str, torch.Tensor], names: Sequence[str] | None
) -> dict[str, torch.Tensor]:
    """The tensors ``names`` names (all of them: None), in that order; a name ``params``
    lacks raises :class:`ValueError`."""
    if names is None:
        return dict(params)
    missing = [name for name in names if name not in params]
    if missing:
        raise ValueError(f"the model has no tensors {missing}")
    return {name: params[name] for name in names}


def take_snapshot(
    params: Mapping[str, torch.Tensor], names: Sequence[str] | None = None
) -> dict[str, torch.Tensor]:
    """S: a detached copy of every tensor (or of those ``names`` names), on its own device."""
    with torch.no_grad():
        return {name: tensor.detach().clone() for name, tensor in select(params, names).items()}


def progress_in_place(
    snapshot: dict[str, torch.Tensor], params: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Turn ``snapshot`` (S) into the progress y - S, in its own memory; return it."""
    _same_names(snapshot, params)
    with torch.no_grad():
        for name, saved in snapshot.items():
            saved.neg_().add_(params[name].detach())
    return snapshot


def add_progress(params: Mapping[str, torch.Tensor], progress: Mapping[str, torch.Tensor]) -> None:
    """y ← y + progress, in place (y holds θ_{r+1} at this point)."""
    _same_names(progress, params)
    with torch.no_grad():
        for name, tensor in params.items():
            tensor.add_(progress[name])


def apply_correction(
    params: Mapping[str, torch.Tensor],
    theta: Mapping[str, torch.Tensor],
    snapshot: dict[str, torch.Tensor],
    fold: Sequence[str] | None = None,
) -> None:
    """y ← θ + (y - S) in place, tensor by tensor; ``snapshot`` is consumed (holds y - S).

    ``fold`` (streaming): only those tensors are corrected, ``snapshot`` holds only them,
    and ``theta`` needs only them; every other tensor of ``params`` is left as it is.
    """
    params = select(params, fold)
    theta = select(theta, fold) if fold is not None else theta
    _same_names(theta, params)
    progress = progress_in_place(snapshot, params)
    with torch.no_grad():
        for name, tensor in params.items():
            tensor.copy_(theta[name])
    add_progress(params, progress)


def _same_names(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    if set(a) != set(b):
        raise ValueError(
            f"tensor names differ: only in one {sorted(set(a) - set(b))}, "
            f"only in the other {sorted(set(b) - set(a))}"
        )
    for name, tensor in a.items():
        if tensor.shape != b[name].shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(b[name].shape)}")


# -- decisions ---------------------------------------------------------------------------


def theta_fragments(
    overlap: str,
    fragments: int | None,
    theta: Mapping[str, torch.Tensor] | Mapping[str, tuple[int, ...]],
) -> FragmentPlan | None:
    """Under ``streaming`` the split of ``theta``'s tensors (or their shapes, as a θ file's
    header gives them) into ``fragments`` (:func:`geofed.fragments.fragment_plan` over
    their shapes, names in θ's order); None (every round synchronizes every tensor)
    otherwise. Raises :class:`~geofed.fragments.FragmentError` when θ cannot be split in
    ``fragments``."""
    if overlap != "streaming":
        return None
    if fragments is None:
        raise ValueError("an overlap: streaming announcement must say its fragments")
    return fragment_plan(shapes_of(theta), fragments)


def round_names(
    overlap: str,
    fragments: int | None,
    theta: Mapping[str, torch.Tensor],
    round_: int,
) -> tuple[str, ...] | None:
    """The tensors round ``round_`` synchronizes: under ``streaming`` its fragment of
    ``theta``'s tensors (:func:`theta_fragments`); None (every tensor) otherwise."""
    plan = theta_fragments(overlap, fragments, theta)
    return None if plan is None else plan.names(round_)


def speculate_next(overlap: str, round_: int, total_rounds: int | None) -> bool:
    """Whether the region starts round ``round_ + 1`` as soon as round ``round_`` trained.

    Not after the job's last round: there is no θ to fold in.
    """
    if overlap not in SPECULATIVE:
        return False
    return total_rounds is None or round_ + 1 < total_rounds


def next_instruction(
    trained: RoundInstruction,
    promised_base: str,
    start: str = "local",
    names: tuple[str, ...] | None = None,
) -> RoundInstruction:
    """The speculative instruction of the round after ``trained``.

    Same job and training settings; the workers start from their local parameters (or,
    ``start`` ``eager``, from the estimate S the agent hands them) and wait for θ at
    ``promised_base`` (the file the agent will write once it has synced it). Whether θ
    is evaluated is decided when it arrives (the base-ready marker says).

    Under ``streaming`` ``names`` is the next round's fragment (what its delta holds),
    and the round folds in only ``trained``'s fragment (what θ changes in).
    """
    delta, fold = trained.delta, None
    if trained.overlap == "streaming":
        if names is None or delta is None or delta.names is None:
            raise ValueError("a streaming round's successor needs both rounds' fragments")
        fold, delta = delta.names, replace(delta, names=names)
    return RoundInstruction(
        job=trained.job,
        round=trained.round + 1,
        base_params=promised_base,
        inner_steps=trained.inner_steps,
        task=trained.task,
        task_options=dict(trained.task_options),
        seed=trained.seed,
        region=trained.region,
        region_index=trained.region_index,
        num_regions=trained.num_regions,
        training=trained.training,
        total_steps=trained.total_steps,
        evaluate_base=False,
        overlap="streaming" if trained.overlap == "streaming" else "delayed",
        base_pending=True,
        start=start,
        delta=delta,
        fold=fold,
        datasets=trained.datasets,
        datasets_without_files=trained.datasets_without_files,
        task_fingerprint=trained.task_fingerprint,
    )


def speculation_unusable(
    speculative: RoundInstruction,
    wanted: RoundInstruction,
    *,
    resync: bool,
    fold: tuple[str, ...] | None = None,
) -> str | None:
    """Why the speculative round cannot stand for ``wanted`` (the serial instruction the
    announcement asks for), or None when its steps count.

    The speculative round must train exactly what the serial one would (same data shard,
    schedule, task, training settings, delta request: under streaming the same fragment)
    from the θ file it promised, and fold in exactly the tensors θ changed in (``fold``:
    the previous round's fragment under streaming; None: every tensor); after a resync
    the region starts from the announced θ, as a serial round does.
    """
    if resync:
        return "the region resyncs its parameters"
    if (speculative.job, speculative.round) != (wanted.job, wanted.round):
        return f"it is round {speculative.round} of {speculative.job}, not the announced one"
    if speculative.base_params != wanted.base_params:
        return f"θ is at {wanted.base_params}, not at the promised {speculative.base_params}"
    if speculative.overlap != wanted.overlap and "streaming" in (
        speculative.overlap,
        wanted.overlap,
    ):
        return f"the job's overlap is {wanted.overlap}, not {speculative.overlap}"
    if speculative.fold != fold:
        return f"it folds in {_listed(speculative.fold)}, θ changed in {_listed(fold)}"
    # θ's hash is not known ahead: the base-ready marker brings it (checked on arrival).
    ignored = {
        "base_params",
        "base_hash",
        "evaluate_base",
        "overlap",
        "base_pending",
        "start",
        "fold",
    }
    for name in RoundInstruction.__dataclass_fields__:
        if name in ignored:
            continue
        if getattr(speculative, name) != getattr(wanted, name):
            return f"the announced round changed {name}"
    return None


def _listed(names: tuple[str, ...] | None) -> str:
    return "every tensor" if names is None else f"the tensors {list(names)}"


def keeps_speculation(
    speculative_round: int,
    announced_round: int,
    state: str,
    participates: bool,
) -> str | None:
    """Why an announcement of the job ends its speculative round, or None if it may go on.

    The speculative round ``s`` goes on while the previous round closes (an announcement
    of round s - 1) and when round s opens with this region among its participants;
    anything else (a skipped or repeated round, a pause, the job's end or cancellation, a
    region left out, a coordinator restored from an older backup) ends it.
    """
    if announced_round == speculative_round - 1 and state in ("open", "closed"):
        return None
    if announced_round == speculative_round and state in ("open", "closed"):
        if not participates:
            return f"this region does not take part in round {announced_round}"
        return None
    if announced_round == speculative_round:
        return f"round {announced_round} is {state}"
    return f"round {announced_round} ({state}) was announced, not round {speculative_round}"
