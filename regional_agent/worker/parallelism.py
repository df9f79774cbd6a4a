"""Data parallelism inside a region: a model wrapped for DDP, FSDP2 or HSDP, and its state.

:func:`wrap` turns a job's bare model (on its device, or on the ``meta`` device:
:mod:`regional_agent.worker.model_build`) into a :class:`ParallelModel` on every rank:

- ``ddp``: replicated parameters and optimizer state, gradients all-reduced
  (``DistributedDataParallel``) in place in its buckets (``gradient_as_bucket_view``: the
  gradients are views of them, not a second copy);
- ``fsdp``: FSDP2 (``fully_shard``) on each unit the task declares
  (:meth:`~geofed.task.Task.fsdp_units`), then the root: parameters, gradients and the
  optimizer state are sharded across the ranks;
- ``hsdp``: the same on a 2-D mesh (:func:`hsdp_mesh`): sharded within groups of ranks,
  replicated across the groups.

The federation sees none of the wrappers. What comes in (the round's base θ) is the
*full* state, held by rank 0 alone: rank 0 reads θ tensor by tensor and scatters each
(:meth:`ParallelModel.load_full_state`), each rank keeping its part (torch's
``set_model_state_dict`` would hold every tensor rank 0 sent until the end: all of θ).
What goes out is read one tensor at a time (:meth:`ParallelModel.gathered`), so no rank
holds a whole copy of a sharded model; the inner optimizer state is saved by each rank,
its own shards (:mod:`regional_agent.worker.optimizer_checkpoint`).
:meth:`ParallelModel.full_state` gathers the whole to rank 0, for an instruction without
a delta request; a whole optimizer state of the format before is loaded by broadcast
from rank 0 (:meth:`ParallelModel.load_optimizer_state`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from geofed.params import federated_state, state_to_fp32
from geofed.training_config import Parallelism, Precision, is_sharded
from regional_agent.worker.comm_timer import CommTimer
from regional_agent.worker.precision import mixed_precision_policy

_TO_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass(frozen=True, slots=True)
class ParallelModel:
    """One job's model on one rank, wrapped for the region's data parallelism.

    ``model`` is the bare module ``build_model`` returned (sharded in place under FSDP);
    ``module`` is what the forward runs through (the DDP wrapper, or the FSDP root).
    ``comm`` times the collectives: DDP's gradient all-reduce, FSDP's all-gathers and
    reduce-scatters, and HSDP's all-reduce between replicas besides
    (:mod:`regional_agent.worker.comm_timer`).
    """

    kind: Parallelism
    model: nn.Module
    module: nn.Module
    comm: CommTimer | None = None

    def gradient_sync(self, enabled: bool) -> AbstractContextManager[object]:
        """The context of one micro-batch's forward and backward.

        DDP without sync accumulates the gradients locally until the step's last
        micro-batch. FSDP reduce-scatters every micro-batch whatever ``enabled`` says:
        skipping it would keep an unsharded fp32 gradient of the whole model on every rank
        until the step's end.
        """
        if not enabled and isinstance(self.module, DistributedDataParallel):
            return self.module.no_sync()
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the gradient's global L2 norm; return the norm before clipping.

        Under FSDP the gradients are DTensor shards and the norm is reduced over the
        ranks; the value is the same on every rank.
        """
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return norm

    def grad_norm(self) -> torch.Tensor:
        """The gradient's global L2 norm, leaving the gradients as they are.

        A collective under FSDP, like :meth:`clip_grad_norm`.
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return norm

    def load_full_state(self, state: Mapping[str, torch.Tensor] | None) -> None:
        """Load rank 0's full federated ``state`` into every rank (a collective).

        Only rank 0 passes ``state``, checked first with
        :func:`geofed.params.check_federated_state`. Its names go to every rank, then its
        tensors one at a time: each taken from ``state`` when its turn comes (a θ read on
        demand is never whole in memory) and scattered to the shards under FSDP/HSDP, or
        broadcast under DDP, into the model's own tensors. Tensors outside the federated
        state (complex RoPE tables, integer buffers) keep what ``build_model`` gave them.
        A ``state`` naming some federated tensors (a streaming fold) loads those; the
        others keep their values, bit for bit. A tensor rank 0 cannot read (a θ file cut
        short, a chained update whose bytes changed) and every one after it are sent as
        zeros, so that its peers finish the load, and then rank 0 raises the read's error:
        the agreement after the load refuses the round on every rank.
        """
        rank0 = dist.get_rank() == 0
        box: list[list[str] | None] = [list(state) if rank0 and state is not None else None]
        dist.broadcast_object_list(box, src=0)
        own = federated_state(self.model)
        failure: ValueError | OSError | None = None
        with torch.no_grad():
            for name in box[0] or []:
                source: torch.Tensor | None = None
                if rank0 and state is not None and failure is None:
                    try:
                        source = state[name]
                    except (ValueError, OSError) as exc:  # ThetaFileError is a ValueError
                        failure = exc
                if rank0 and source is None:
                    source = torch.zeros(own[name].shape)
                load_whole_tensor(own[name], source)
        if failure is not None:
            raise failure

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The trained federated state as fp32 CPU tensors on rank 0; None elsewhere.

        A collective under FSDP (each parameter gathered in turn); rank 0 copies its
        replica under DDP.
        """
        if is_sharded(self.kind):
            full = get_model_state_dict(self.model, options=_TO_RANK0)
            if dist.get_rank() != 0:
                return None
            tensors = {name: v for name, v in full.items() if isinstance(v, torch.Tensor)}
            return state_to_fp32(federated_state(tensors))
        return state_to_fp32(self.model) if dist.get_rank() == 0 else None

    def gathered(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each named federated tensor whole, one at a time, in ``names``' order.

        Under FSDP every tensor is all-gathered (a collective per tensor: every rank
        iterates the same names to the end), so no rank ever holds more than one whole
        tensor beyond its shards; under DDP the replica's own tensors (no copy).
        """
        state = federated_state(self.model)
        for name in names:
            tensor = state[name]
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            yield name, tensor.detach()

    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
    ) -> None:
        """Load a state :meth:`optimizer_state` saved into a freshly built optimizer.

        DDP: every rank loads the state it read. FSDP: rank 0's state is broadcast
        and each rank keeps its shard (a collective; the other ranks' copies are unused).
        """
        if is_sharded(self.kind):
            given = dict(state) if dist.get_rank() == 0 else {}
            set_optimizer_state_dict(
                self.model,
                optimizer,
                given,
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            )
            return
        optimizer.load_state_dict(dict(state))


def load_whole_tensor(target: torch.Tensor, source: torch.Tensor | None) -> None:
    """Copy rank 0's whole ``source`` into ``target`` on every rank (a collective): its
    shards scattered to a sharded tensor's ranks, or the whole broadcast to a replica."""
    device, dtype = target.device, target.dtype
    whole = (
        source.detach().to(device=device, dtype=dtype)
        if source is not None
        else torch.empty(target.shape, device=device, dtype=dtype)
    )
    if isinstance(target, DTensor):
        shards = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=0)
        target.to_local().copy_(shards.to_local())
        return
    dist.broadcast(whole, src=0)
    target.copy_(whole)


def hsdp_mesh(device: torch.device, shard_ranks: int, timeout: timedelta) -> DeviceMesh:
    """The 2-D mesh of HSDP: shard groups of ``shard_ranks`` consecutive ranks (a node's,
    by default), replicated across the groups (a collective). Its process groups wait
    ``timeout`` for a peer, as the group's own do, not torch's default 30 minutes."""
    world = dist.get_world_size()
    if shard_ranks < 1 or world % shard_ranks:
        raise ValueError(
            f"hsdp: shard groups of {shard_ranks} ranks do not divide the group's {world} ranks"
        )
    backend = dist.get_backend()
    # The backends' option classes are not in torch's type stubs.
    kind: Any = dist.ProcessGroupNCCL if backend == "nccl" else dist.ProcessGroupGloo
    options = kind.Options() if backend == "nccl" else kind._Options()
    options._timeout = timeout
    return init_device_mesh(
        device.type,
        (world // shard_ranks, shard_ranks),
        mesh_dim_names=("replicate", "shard"),
        backend_override={"replicate": (backend, options), "shard": (backend, options)},
    )


def wrap(
    model: nn.Module,
    parallelism: Parallelism,
    precision: Precision,
    device: torch.device,
    fsdp_units: Sequence[nn.Module] = (),
    materialize: Callable[[nn.Module], None] | None = None,
    shard_ranks: int | None = None,
    timeout: timedelta = timedelta(minutes=10),
) -> ParallelModel:
    """Wrap ``model`` for the region's parallelism (a collective).

    ``hsdp`` shards within groups of ``shard_ranks`` ranks (:func:`hsdp_mesh`; default:
    every rank, which is ``fsdp``) and replicates across them: the gradients are
    reduce-scattered inside a group and all-reduced between groups.

    ``model`` is on ``device``, or on the ``meta`` device with ``materialize`` given:
    then its storage is allocated on ``device`` only after sharding (each rank allocates
    its shards, never the whole model) and ``materialize`` fills the tensors θ does not
    carry; the federated ones are loaded from θ before any use.
    """
    on_meta = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    if on_meta and materialize is None:
        raise ValueError("a model on the meta device needs a materialize function")
    if is_sharded(parallelism):
        policy = mixed_precision_policy(precision)
        mesh = None
        if parallelism == "hsdp":
            shard = dist.get_world_size() if shard_ranks is None else shard_ranks
            mesh = hsdp_mesh(device, shard, timeout)
        for unit in fsdp_units:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)  # the same module, an FSDPModule too
        if on_meta and materialize is not None:
            model.to_empty(device=device)
            materialize(model)
        comm = CommTimer(device)
        comm.attach_fsdp([*fsdp_units, model], replicated=parallelism == "hsdp")
        return ParallelModel(parallelism, model, model, comm)
    if on_meta and materialize is not None:
        model.to_empty(device=device)
        materialize(model)
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    comm = CommTimer(device)
    comm.attach(ddp)
    return ParallelModel("ddp", model, ddp, comm)
