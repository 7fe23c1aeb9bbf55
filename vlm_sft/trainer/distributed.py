"""Process group, device, FSDP2 sharding, and the rules every collective of the trainer follows.

accelerate is the launcher and the environment (it sets RANK / WORLD_SIZE / LOCAL_RANK like torchrun); sharding is
ours, done with ``torch.distributed.fsdp.fully_shard`` on a device mesh, so the same code path runs on CPU (gloo) and
CUDA (NCCL). accelerate's own FSDP plugin does not shard on CPU, which is why it is not used (measured-facts.md).

The collective rules (tests/test_distributed.py holds the code to them):

1. **Which device serves which collective.** NCCL serves CUDA tensors only ("No backend type associated with device
   type cpu"), so on CUDA the process group is created as ``cpu:gloo,cuda:nccl``: FSDP's parameter and gradient
   collectives run on the GPU through NCCL, and the trainer's own small ones through gloo.
2. **The trainer's own collectives are control-plane and take host tensors.** Token counts, step agreement, eval
   sums and flags are CPU tensors of a few numbers: they go through ``all_reduce`` / ``check_peers`` here (nowhere
   else in the package calls ``torch.distributed`` directly), which refuse a device tensor. That way a
   reduction never forces a GPU stream to sync for a handful of integers, and no call site can hand NCCL a CPU
   tensor by accident.
3. **A failure on one rank stops every rank.** A rank-local section (loading batches, writing files on rank 0, the
   packing self-check) runs inside ``all_ranks_or_none``: afterwards every rank learns, in one all-reduce, whether
   any rank failed; the lowest failing rank raises its own error (so the message is printed once) and the others
   raise ``PeerFailure`` naming it, instead of waiting in their next collective until the NCCL timeout.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from vlm_sft.config import ConfigError
from vlm_sft.model.context_parallel import NO_CP, ContextParallel

logger = logging.getLogger(__name__)

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


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
        """More than one process: collectives are real."""
        return self.world_size > 1

    @property
    def sharded(self) -> bool:
        """The model is wrapped by FSDP2: with several processes, and on CUDA always (one GPU too), so bf16 runs
        get FSDP's mixed precision (bf16 compute over fp32 master weights) on one GPU exactly as on many."""
        return self.distributed or self.device.type == "cuda"


class PeerFailure(RuntimeError):
    """Raised on the ranks that did not fail when another rank did, so that every rank stops at the same point."""

    def __init__(self, what: str, failures: dict[int, str]) -> None:
        self.what = what
        self.failures = failures
        ranks = ", ".join(str(r) for r in sorted(failures))
        super().__init__(f"stopped: rank {ranks} failed while {what} (its error is printed by that rank)")


def resolve_device(preference: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without a GPU is an error that says so."""
    if preference == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    if preference == "cuda":
        raise RuntimeError("train.device = 'cuda' but no CUDA device is visible; set train.device = 'cpu' or 'auto'")
    return torch.device("cpu")


def process_group_backend(device: torch.device) -> str:
    """The backend map of the process group (rule 1): gloo for CPU tensors always, NCCL for CUDA tensors on CUDA."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "cpu:gloo"


def init_distributed(device_preference: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    """Join the process group the launcher described in the environment (or stay single-process on CPU).

    On CUDA a single process still gets a one-rank group (an in-memory store, no launcher needed), because the model
    is sharded there too (``DistEnv.sharded``).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_preference, local_rank)
    env = DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.sharded and not dist.is_initialized():
        backend = process_group_backend(device)
        kwargs: dict = {"timeout": timedelta(seconds=timeout_s)}
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            kwargs |= {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        dist.init_process_group(backend=backend, **kwargs)
        logger.info("rank %d/%d joined the process group (%s) on %s", rank, world_size, backend, device)
    return env


def shard_model(model: nn.Module, env: DistEnv, *, param_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2: ``fully_shard`` every decoder layer, the vision tower, then the root (when ``env.sharded``).

    Each rank then holds 1/world_size of every parameter. The vision tower is its own unit, so its all-gather is one
    collective that every rank issues on every forward: the model always runs the tower (a dummy input on text-only
    micro-batches), which keeps the ranks' collective sequences identical. ``param_dtype`` (bf16 runs): FSDP gathers
    and computes in that dtype over fp32 master weights, and reduces gradients in fp32.
    """
    if not env.sharded:
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


def context_parallel_groups(env: DistEnv, cp_size: int) -> tuple[ContextParallel, int, int]:
    """``(this rank's CP group, data-parallel rank, data-parallel size)`` for ``train.cp_size``.

    CP groups are ``cp_size`` consecutive ranks (one node's GPUs, where the all-to-alls are fast); the group's
    index is the rank's data-parallel rank. ``new_group`` is collective: every rank creates every group, in order.
    The groups' all-to-alls are the model's data plane (device tensors, NCCL on CUDA), like FSDP's collectives;
    sharding stays FSDP2 over all ranks (``shard_model``), whose average the trainer's loss scale accounts for.
    """
    if env.world_size % cp_size:
        raise ConfigError(
            f"train.cp_size = {cp_size} does not divide the {env.world_size} ranks; launch a multiple of {cp_size} "
            "processes or change cp_size"
        )
    if cp_size == 1:
        return NO_CP, env.rank, env.world_size
    mine = None
    for start in range(0, env.world_size, cp_size):
        group = dist.new_group(list(range(start, start + cp_size)))
        if start <= env.rank < start + cp_size:
            mine = group
    cp = ContextParallel(group=mine, rank=env.rank % cp_size, size=cp_size)
    return cp, env.rank // cp_size, env.world_size // cp_size


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduce-scatters gradients (FSDP2); off for all but the last micro-batch of a step.

    With sync off, FSDP2 keeps each unit's unsharded gradient (accumulated in its reduce dtype, fp32) until the last
    micro-batch, then reduces once: 1/micro_batches of the gradient traffic, for one unsharded gradient of the model
    held per rank during the step. A no-op for a model that is not sharded.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def _host(value: torch.Tensor, what: str) -> torch.Tensor:
    if value.device.type != "cpu":
        raise ValueError(
            f"{what} got a tensor on {value.device}: the trainer's collectives take host (CPU) tensors, served by "
            "gloo (see vlm_sft/trainer/distributed.py); read device values once with .cpu() before reducing"
        )
    return value


def all_reduce(value: torch.Tensor, env: DistEnv, op: str = "sum") -> torch.Tensor:
    """Reduce a CPU tensor over all ranks with ``sum`` / ``max`` / ``min`` (identity when single-process)."""
    _host(value, "all_reduce")
    if env.distributed:
        value = value.clone()
        dist.all_reduce(value, op=REDUCE_OPS[op])
    return value


def all_reduce_sum(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a CPU tensor over all ranks (identity when single-process)."""
    return all_reduce(value, env, "sum")


def gather_objects(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's picklable ``obj`` on every rank, in rank order (over gloo: host objects only, no device
    tensors). For small reports such as the data accounting, at moments every rank reaches together."""
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def check_peers(
    env: DistEnv, what: str, error: Exception | None = None, values: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Every rank says whether it failed ``what`` (one all-reduce, which also sums ``values`` if given).

    If any rank failed, the lowest failing rank raises its own ``error`` and every other rank ``PeerFailure``
    (so an error every rank hit, e.g. a bad setting, is printed once); otherwise returns the summed ``values``
    (a CPU float64 tensor) or None.
    """
    flag = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64)
    local = flag if values is None else torch.cat([flag, _host(values, "check_peers").double()])
    total = all_reduce_sum(local, env)
    if float(total[0]) > 0:
        messages: list[str | None] = [None] * env.world_size
        if env.distributed:
            dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
        failures = {r: m for r, m in enumerate(messages) if m is not None} or {env.rank: str(error)}
        if error is not None and env.rank == min(failures):
            raise error
        raise PeerFailure(what, failures)
    return None if values is None else total[1:]


@contextmanager
def all_ranks_or_none(env: DistEnv, what: str) -> Iterator[None]:
    """Runs a rank-local section (no collectives inside), then ``check_peers``: all ranks go on, or all stop."""
    error = None
    try:
        yield
    except Exception as exc:  # told to the peers first, then re-raised on this rank by check_peers
        error = exc
    check_peers(env, what, error)


def cleanup(env: DistEnv, *, finished: bool) -> None:
    """Leave the process group (every rank, at exit, success or failure).

    ``finished`` (every rank got through the run): a barrier first, so no rank tears its gloo pairs down while a peer
    still has work in flight on them. That alone did not stop the abort at exit after a finished run ("terminate
    called without an active exception"): it happens later, in the interpreter's teardown, which the CLI skips
    (``end_process``). After a failure there is no barrier: the failed rank's peers may never reach it."""
    if env.sharded and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def end_process(code: int) -> NoReturn:
    """End a process of a multi-process run with ``code``, without the interpreter's teardown.

    A finished multi-process run on gloo sometimes aborted after its last line of Python ("terminate called without
    an active exception", SIGABRT), so its launcher reported a failure for a run whose work was complete. It struck
    2- and 4-process runs (1 in 38 repeats of a 4-process context-parallel run here, and CI twice), with the barrier
    and ``destroy_process_group`` of ``cleanup`` done; Python's fault handler showed no Python frame, i.e. the abort is
    in the C++ destructors that run while the interpreter finalizes. Every file the trainer writes is closed by then
    (checkpoints, metrics, accounting), so what is left to do is flush what Python still buffers (the log handlers,
    stdout, stderr) and leave with ``os._exit``, which skips those destructors. Only the CLI calls this, never
    ``train()`` (a caller in the same process, e.g. a test, keeps its interpreter)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded DTensor (an all-gather every rank must join, in the same order), waited for.

    ``DTensor.full_tensor`` may return an ``AsyncCollectiveTensor`` whose collective is still in flight; a rank that
    drops it unread (the export's and the self-check's non-writing ranks) would leave gloo work pending when the
    process group is destroyed, which aborts the process at exit ("terminate called without an active exception").
    A plain tensor is returned as it is."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    full = t.full_tensor()
    return full.wait() if isinstance(full, AsyncCollectiveTensor) else full
