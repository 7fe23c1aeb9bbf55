"""FSDP2 applied to a list of units, gradient sync, and the row rule every reader and writer of its shards uses.

``fully_shard_units`` shards each given unit, then the root, over one 1-D mesh (``parallel.mesh``: every rank of the
job), so each rank holds ``1 / world_size`` of every parameter; which modules are units is ``parallel.parallelize``'s
choice, the only code that knows the model's module paths. ``param_dtype`` (bf16 runs): FSDP gathers and computes in
that dtype over fp32 master weights, and reduces gradients in fp32.

**The row rule.** FSDP2 places every parameter as ``Shard(0)`` over its 1-D mesh, in ``torch.chunk`` pieces: the first
ranks hold ``ceil(n / W)`` rows, the last ones fewer or none (expert parallelism's experts: a range of their group's
block, ``parallel.expert_parallel``). The sharded checkpoint load (each rank reads its rows), the LoRA init (each rank
keeps its rows of one draw) and the self-check's slice (each rank contributes its rows) all need that range
(``local_rows``); a plain tensor is held whole, a replicated DTensor too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial

# Private, but DCP's own rule for where a rank's piece of a DTensor sits in the whole.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def fully_shard_units(
    units: Iterable[nn.Module], root: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype | None = None
) -> nn.Module:
    """``fully_shard`` every unit in order, then ``root`` (which takes the parameters no unit holds); returns ``root``.

    Each unit's all-gather is one collective that every rank issues on every forward that runs it, so units must run
    on every rank in every forward (the model runs its vision tower on a dummy image when a micro-batch has none).
    A module already sharded (expert parallelism's experts, on their own mesh) stays its own unit."""
    for unit in units:
        fully_shard_on(unit, mesh, param_dtype=param_dtype)
    return fully_shard_on(root, mesh, param_dtype=param_dtype)


def fully_shard_on(module: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard(module)`` over ``mesh``; ``param_dtype``: gathered and computed in it, gradients reduced in
    fp32."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    return fully_shard(module, mesh=mesh, **({"mp_policy": mp} if mp else {}))


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduce-scatters gradients (FSDP2); off for all but the last micro-batch of a step.

    With sync off, FSDP2 keeps each unit's unsharded gradient (accumulated in its reduce dtype, fp32) until the last
    micro-batch, then reduces once: 1/micro_batches of the gradient traffic, for one unsharded gradient of the model
    held per rank during the step. A no-op for a model that is not sharded.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Clip the gradients of ``params`` to a total 2-norm of ``max_norm`` (None: no clipping); returns the norm as a
    plain device scalar, read later with the step's other figures (no host sync here).

    torch's ``clip_grad_norm_`` stacks the per-parameter norms, which DTensors on different meshes refuse (FSDP2's
    shards live on the whole mesh, expert parallelism's experts on the ``(edp, ep)`` mesh): the norm is taken per
    mesh here, each made whole, then combined."""
    params = [p for p in params if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    if len(by_mesh) <= 1:  # one mesh (or none): torch's own
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm is not None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in params)], coef)
    return total


def copy_to(t: torch.Tensor, device: torch.device, *, pin_memory: bool = False) -> torch.Tensor:
    """A copy of ``t`` on ``device``, issued asynchronously where it can be (``non_blocking``); a DTensor's copy is a
    DTensor of the same mesh, placements and shape whose local shard lives on ``device``, also when that is the host
    and the mesh's device is a GPU (as FSDP2's own CPU offload holds its shards). ``pin_memory``: the copy in
    page-locked host memory (CUDA runs), so both directions of the copy run asynchronously."""
    if isinstance(t, DTensor):
        local = copy_to(t.to_local(), device, pin_memory=pin_memory)
        # From the spec: DTensor.from_local would move the shard to the mesh's device.
        return DTensor(local, t._spec, requires_grad=False)
    if pin_memory:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
    return t.to(device, non_blocking=True, copy=True)


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (a parameter or state tensor of a sharded model), i.e. not held whole here."""
    return isinstance(t, DTensor)


def shard_ranks(t: torch.Tensor) -> int:
    """How many ranks ``t`` is spread over (1 for a plain tensor)."""
    return t.device_mesh.size() if isinstance(t, DTensor) else 1


def local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(local tensor, first row, end row)`` of ``t`` on dim 0 for this rank (all rows of a plain or replicated
    tensor), for any layout that splits dim 0 alone into one contiguous range per rank: FSDP2's ``Shard(0)``, and
    expert parallelism's ``(_StridedShard(0), Shard(0))`` over ``(edp, ep)`` (torch's own offset rule, the one DCP
    uses). Any other layout is refused: filling it with the wrong rows would be silent."""
    if not isinstance(t, DTensor):
        return t, 0, (t.shape[0] if t.dim() else 0)
    local = t.to_local()
    if not t.dim():
        return local, 0, 0
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape[1:]) != tuple(t.shape[1:]) or any(isinstance(p, Partial) for p in t.placements):
        raise NotImplementedError(f"only layouts that split dim 0 are supported, got placements {t.placements}")
    start, stop = min(offset[0], t.shape[0]), min(offset[0] + shape[0], t.shape[0])
    if local.shape[0] != stop - start:  # raised, not asserted: under python -O the wrong rows would be filled silently
        raise ShardLayoutError(
            f"this rank's shard has {local.shape[0]} rows where torch's offset rule gives rows {start}:{stop} of "
            f"{t.shape[0]} (placements {t.placements}): a sharding layout this code does not know"
        )
    return local, start, stop


class ShardLayoutError(RuntimeError):
    """A DTensor's local shard does not hold the rows the row rule says it does (module docstring)."""
