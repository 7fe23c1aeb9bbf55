"""Expert parallelism: each MoE layer's routed experts split over a group of ranks, tokens sent to their experts.

``train.ep_size`` consecutive ranks form an expert-parallel group (``parallel.mesh``'s ``ep`` dimension); rank ``r``
of a group holds experts ``[r * E / ep, (r + 1) * E / ep)`` of every MoE layer whole, as a DTensor sharded on dim 0
over the group (``shard_experts``), so the checkpoint keys, DCP's resharding (another ``ep_size`` or world size), the
sharded load (each rank reads its experts' rows: ``parallel.fsdp.local_rows``) and the streamed export see the usual
``[E, ...]`` tensors. FSDP2 leaves these parameters alone (``ignored_params``): they are never all-gathered. The
groups that hold the same experts (``edp``, the rest of data parallelism) each keep a copy.

The forward of each layer's ``Experts`` is wrapped from outside (``wrap_experts``; the model stays free of
``torch.distributed``), around the same routing (router, top-k and weights are computed on the token's own rank):

1. the ``N = T * K`` routed slots are sorted by expert (``moe.sort_by_expert``), so the slots for rank ``j``'s
   experts are one contiguous block; the block sizes are exchanged first (one all-to-all of ``ep`` counts, read on
   the host once per layer: the variable-size all-to-all needs them);
2. **dispatch**: one all-to-all of variable sizes sends every slot's hidden state (and its expert's local index) to
   the rank that holds its expert; **no slot is ever dropped** (no capacity factor);
3. each rank runs its experts over the slots it received, by the run's expert path (``sorted`` / ``grouped_mm``),
   unweighted;
4. **combine**: the reverse all-to-all brings each slot's output home, where it is scaled by its routing weight,
   put back in token order and summed over the k experts, exactly as ``moe.sorted_experts_mlp`` does.

Both all-to-alls are autograd-aware: backward sends the gradients the other way. A rank that receives no slot still
joins both (its experts get a zero gradient), so every rank issues the same collectives.

**Gradients.** The loss scale (``trainer.loop``) assumes FSDP2's average over all ``W`` ranks. An expert's local
gradient already sums the contributions of every token its group dispatched to it, so ``reduce_expert_gradients``
sums it over the copies (``edp``) and divides by ``W``: the same gradient as without expert parallelism. It runs once
per optimizer step, after the last micro-batch's backward.

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


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's expert-parallel group and the copies of its experts elsewhere."""

    mesh: DeviceMesh
    """The 1-D ``ep`` mesh of this rank's group (the experts' DTensors live on it)."""
    rank: int
    """This rank's place in its group: it holds experts ``[rank * L, (rank + 1) * L)``."""
    size: int
    """``train.ep_size``."""
    replicas: dist.ProcessGroup | None
    """The ranks that hold the same experts (one per group; None when there is one group)."""
    world_size: int
    """All ranks of the job: what the expert gradients are divided by (FSDP2's average)."""

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()


# ------------------------------------------------------------------------------------------------ the layout


def shard_experts(module: Experts, ep: ExpertParallel) -> list[nn.Parameter]:
    """Replace ``module``'s two expert tensors by DTensors holding this rank's ``E / ep`` experts (also on the meta
    device, before any weight exists); returns the new parameters (for FSDP2's ``ignored_params``)."""
    out = []
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
        param = nn.Parameter(dtensor, requires_grad=full.requires_grad)
        setattr(module, name, param)
        out.append(param)
    return out


def wrap_experts(modules: Iterable[Experts], ep: ExpertParallel) -> None:
    """Give each ``Experts`` module the dispatch / compute / combine forward (accelerate's hook convention: the
    instance's ``forward`` is replaced, the module tree and parameter names stay)."""
    for module in modules:
        module.forward = functools.update_wrapper(functools.partial(_ep_forward, module, ep), Experts.forward)
        module.expert_parallel = ep


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


# ------------------------------------------------------------------------------------------------ gradients


def reduce_expert_gradients(modules: Iterable[Experts]) -> None:
    """Sum each expert gradient over the ranks that hold the same experts and divide by the world size (module
    docstring); a parameter that got no gradient takes part with zeros, so every rank issues the same collectives."""
    for module in modules:
        ep: ExpertParallel = module.expert_parallel
        for param in (module.gate_up_proj, module.down_proj):
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            local = param.grad.to_local()
            if ep.replicas is not None:
                dist.all_reduce(local, group=ep.replicas)
            local.div_(ep.world_size)
