"""Process group, device and FSDP2 sharding.

accelerate is the launcher and the environment (it sets RANK / WORLD_SIZE / LOCAL_RANK like torchrun); sharding is
ours, done with ``torch.distributed.fsdp.fully_shard`` on a device mesh, so the same code path runs on CPU (gloo) and
CUDA (NCCL). accelerate's own FSDP plugin does not shard on CPU, which is why it is not used (measured-facts.md).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    """Global rank (0 when not distributed)."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank on this node; selects the CUDA device."""
    device: torch.device
    """Device this rank computes on."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(preference: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without a GPU is an error that says so."""
    if preference == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    if preference == "cuda":
        raise RuntimeError("train.device = 'cuda' but no CUDA device is visible; set train.device = 'cpu' or 'auto'")
    return torch.device("cpu")


def init_distributed(device_preference: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    """Join the process group the launcher described in the environment (or stay single-process)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_preference, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        logger.info("rank %d/%d joined the %s process group on %s", rank, world_size, backend, device)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def shard_model(model: nn.Module, env: DistEnv, *, param_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2: ``fully_shard`` every decoder layer, the vision tower, then the root.

    Each rank then holds 1/world_size of every parameter. The vision tower is its own unit, so its all-gather is one
    collective that every rank issues on every forward: the model always runs the tower (a dummy input on text-only
    micro-batches), which keeps the ranks' collective sequences identical.
    """
    if not env.distributed:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mesh": mesh} | ({"mp_policy": mp} if mp else {})
    inner = model.model
    for layer in inner.language_model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(inner.visual, **kwargs)
    fully_shard(model, **kwargs)
    return model


def all_reduce(value: torch.Tensor, env: DistEnv, op: str = "sum") -> torch.Tensor:
    """Reduce a CPU tensor over all ranks with ``sum`` / ``max`` / ``min`` (identity when single-process)."""
    if env.distributed:
        value = value.clone()
        dist.all_reduce(value, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return value


def all_reduce_sum(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a tensor over all ranks (identity when single-process)."""
    return all_reduce(value, env, "sum")


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def cleanup(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()
