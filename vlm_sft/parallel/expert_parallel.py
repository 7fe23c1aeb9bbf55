"""Expert parallelism: each MoE layer's routed experts split over a group of ranks, tokens sent to their experts.

``train.ep_size`` consecutive ranks form a group (the mesh's ``ep`` dimension); group rank ``r`` holds experts
``[r * E / ep, (r + 1) * E / ep)`` of every layer (``shard_experts``), and FSDP2 shards them further over the ranks
that hold the same ones (``edp``; ``fully_shard_experts``: one unit per layer, gathered over ``edp`` only), so a rank
holds ``1 / W`` of the experts. They stay DTensors of the usual ``[E, ...]`` shape, so checkpoints, DCP resharding,
the sharded load and the export see no difference.

``wrap_experts`` wraps each layer's ``Experts`` from outside (the model never imports ``torch.distributed``), after
routing on the token's own rank:

1. the ``N = T * K`` slots are sorted by expert and the block sizes exchanged (one small all-to-all, read on the host);
2. **dispatch**: one variable-size all-to-all sends every slot to its expert's rank; no slot is dropped;
3. each rank runs its experts over what it received (``sorted`` / ``grouped_mm``), unweighted;
4. **combine**: the reverse all-to-all brings the outputs home, weighted and summed as ``moe.sorted_experts_mlp`` does.

Both all-to-alls carry gradients back, and a rank with no slot still joins them. FSDP2's reduce-scatter over ``edp``
divides the expert gradients by ``W`` (``set_gradient_divide_factor``): the update of ``ep_size = 1``. The design and
its tests: docs/moe.md, "Expert parallelism".

Legend: T = tokens, D = hidden size, E = experts (global), L = experts on this rank (E / ep), K = experts per token,
N = T * K routed slots, R = slots received from the group, F = 2I fused gate and up rows, I = expert width.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from vlm_sft.config import ConfigError
from vlm_sft.model.moe import Experts, grouped_experts_mlp, sort_by_expert, sorted_experts_mlp, weighted_token_sum
from vlm_sft.parallel.fsdp import fully_shard_on


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's expert-parallel group and the copies of its experts elsewhere."""

    mesh: DeviceMesh
    """The 1-D ``ep`` mesh of this rank's group (the experts' DTensors live on it)."""
    rank: int
    """This rank's place in its group: it holds experts ``[rank * L, (rank + 1) * L)``."""
    size: int
    """``train.ep_size``."""
    edp_mesh: DeviceMesh
    """The 1-D ``edp`` mesh: the ranks that hold the same experts (one per group), which FSDP2 shards them over;
    a mesh of one rank when ``ep_size`` is the world size."""
    world_size: int
    """All ranks of the job: what the expert gradients are divided by (FSDP2's average)."""

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()


# ------------------------------------------------------------------------------------------------ the layout


def shard_experts(module: Experts, ep: ExpertParallel) -> None:
    """Replace ``module``'s two expert tensors by DTensors holding this rank's ``E / ep`` experts (also on the meta
    device, before any weight exists)."""
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(module, name)
        experts = full.shape[0]
        if experts % ep.size:
            raise ConfigError(
                f"num_experts = {experts} does not split over train.ep_size = {ep.size}: choose an ep_size that "
                "divides it"
            )
        local = full.detach().narrow(0, ep.rank * (experts // ep.size), experts // ep.size).clone()
        dtensor = DTensor.from_local(
            local, ep.mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
        setattr(module, name, nn.Parameter(dtensor, requires_grad=full.requires_grad))


def fully_shard_experts(modules: Iterable[Experts], ep: ExpertParallel, *, param_dtype: torch.dtype | None) -> None:
    """FSDP2 over ``edp`` for each module's experts (already ``shard_experts``'d), each module a unit of its own, its
    gradient divided by the world size (module docstring); before the decoder layers are sharded, which then leave
    these parameters to their unit.

    gloo has no ``PREMUL_SUM`` (torch's reduce op for a custom divide factor), so the reduction is forced to a sum
    with the division after it; not on a one-rank ``edp``, where torch 2.13's single-rank branch already divides by
    the factor and the forced post-division would divide a second time (measured: 1/W^2)."""
    for module in modules:
        fully_shard_on(module, ep.edp_mesh, param_dtype=param_dtype)
        module.set_gradient_divide_factor(float(ep.world_size))
        if ep.edp_mesh.size() > 1:
            module.set_force_sum_reduction_for_comms(True)


def wrap_experts(modules: Iterable[Experts], ep: ExpertParallel) -> None:
    """Give each ``Experts`` module the dispatch / compute / combine forward (accelerate's hook convention: the
    instance's ``forward`` is replaced, the module tree and parameter names stay)."""
    for module in modules:
        module.forward = functools.update_wrapper(functools.partial(_ep_forward, module, ep), Experts.forward)


# ------------------------------------------------------------------------------------------------ the forward


def _ep_forward(
    module: Experts,
    ep: ExpertParallel,
    x_TD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    impl: str = "sorted",
) -> torch.Tensor:
    """``Experts.forward`` under expert parallelism (module docstring): the routed experts' weighted sum ``[T, D]``."""
    top_k = experts_TK.shape[1]
    gate_up_LFD, down_LDI = module.gate_up_proj.to_local(), module.down_proj.to_local()
    local = gate_up_LFD.shape[0]
    order_N, offsets_E = sort_by_expert(experts_TK, local * ep.size)
    send, recv = _exchange_counts(offsets_E[local - 1 :: local], ep)
    x_ND = x_TD[order_N // top_k]
    local_N = (experts_TK.reshape(-1)[order_N] % local).to(torch.int64)
    x_RD = fc.wait_tensor(fc.all_to_all_single_autograd(x_ND, recv, send, ep.group))
    local_R = fc.wait_tensor(fc.all_to_all_single(local_N, recv, send, ep.group))
    y_RD = _local_experts(x_RD, gate_up_LFD.to(x_RD.dtype), down_LDI.to(x_RD.dtype), local_R, impl)
    y_ND = fc.wait_tensor(fc.all_to_all_single_autograd(y_RD, send, recv, ep.group))
    return weighted_token_sum(y_ND, order_N, weights_TK)


def _exchange_counts(ends_P: torch.Tensor, ep: ExpertParallel) -> tuple[list[int], list[int]]:
    """``(slots this rank sends to each group rank, slots it receives from each)``: ``ends_P`` ends each rank's block
    of the sorted slots; one all-to-all of the counts, then one host read of both lists."""
    send_P = torch.diff(ends_P.to(torch.int64), prepend=ends_P.new_zeros(1, dtype=torch.int64))
    recv_P = fc.wait_tensor(fc.all_to_all_single(send_P, None, None, ep.group))
    counts = torch.cat([send_P, recv_P]).tolist()
    return counts[: ep.size], counts[ep.size :]


def _local_experts(
    x_RD: torch.Tensor, gate_up_LFD: torch.Tensor, down_LDI: torch.Tensor, local_R: torch.Tensor, impl: str
) -> torch.Tensor:
    """Each received slot through its (local) expert, unweighted: ``[R, D]``. With no slot, an empty output that
    still depends on the inputs and the weights, so backward runs the combine's and the dispatch's all-to-alls on
    this rank too (the peers wait for them) and the experts get a zero gradient."""
    if x_RD.shape[0] == 0:
        return x_RD + 0.0 * (gate_up_LFD.sum() + down_LDI.sum())
    ones_R1 = x_RD.new_ones(x_RD.shape[0], 1)
    mlp = grouped_experts_mlp if impl == "grouped_mm" else sorted_experts_mlp
    return mlp(x_RD, gate_up_LFD, down_LDI, local_R[:, None], ones_R1)
