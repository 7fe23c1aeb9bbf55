"""The trainer's own collectives, and the rules they follow (tests/test_distributed.py holds the code to them).

1. **They are control-plane and take host tensors.** Token counts, step agreement, eval sums and flags are CPU
   tensors of a few numbers: they go through ``all_reduce`` / ``check_peers`` here, which refuse a device tensor and
   are served by gloo (``parallel.env``). That way a reduction never forces a GPU stream to sync for a handful of
   integers, and no call site can hand NCCL a CPU tensor by accident.
2. **A failure on one rank stops every rank.** A rank-local section (loading batches, writing files on rank 0, the
   packing self-check) runs inside ``all_ranks_or_none``: afterwards every rank learns, in one all-reduce, whether
   any rank failed; the lowest failing rank raises its own error (so the message is printed once) and the others
   raise ``PeerFailure`` naming it, instead of waiting in their next collective until the timeout.
3. **A sharded tensor is gathered whole with ``full_tensor``**, which waits for the gather (a rank that drops an
   unwaited gather aborts at exit).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from vlm_sft.parallel.env import DistEnv
from vlm_sft.parallel.failure import PeerFailure, doing, mark_agreed

__all__ = [
    "PeerFailure",
    "all_ranks_or_none",
    "all_reduce",
    "all_reduce_sum",
    "check_peers",
    "full_tensor",
    "gather_objects",
]

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _host(value: torch.Tensor, what: str) -> torch.Tensor:
    if value.device.type != "cpu":
        raise ValueError(
            f"{what} got a tensor on {value.device}: the trainer's collectives take host (CPU) tensors, served by "
            "gloo (see vlm_sft/parallel/collectives.py); read device values once with .cpu() before reducing"
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
    (a CPU float64 tensor) or None. When the all-reduce itself fails (a peer died) on a rank that had failed, that
    rank raises its own ``error``, the collective's failure chained to it: the cause of its stop is never lost.
    """
    flag = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64)
    local = flag if values is None else torch.cat([flag, _host(values, "check_peers").double()])
    try:
        total = all_reduce_sum(local, env)
    except RuntimeError as reduce_error:  # torch.distributed's errors (DistBackendError, ...) are RuntimeErrors
        if error is None:
            raise
        error.add_note(f"(telling the other ranks failed too: {type(reduce_error).__name__}: {reduce_error})")
        raise error from reduce_error
    if float(total[0]) > 0:
        messages: list[str | None] = [None] * env.world_size
        if env.distributed:
            dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
        failures = {r: m for r, m in enumerate(messages) if m is not None} or {env.rank: str(error)}
        if error is not None and env.rank == min(failures):
            mark_agreed(error)  # every rank knows: the failure board need not tell them
            raise error
        raise PeerFailure(what, failures)
    return None if values is None else total[1:]


@contextmanager
def all_ranks_or_none(env: DistEnv, what: str) -> Iterator[None]:
    """Runs a rank-local section (no collectives inside), then ``check_peers``: all ranks go on, or all stop."""
    error = None
    try:
        with doing(what):
            yield
    except Exception as exc:  # told to the peers first, then re-raised on this rank by check_peers
        error = exc
    check_peers(env, what, error)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded DTensor (an all-gather every rank must join, in the same order), waited for.

    ``DTensor.full_tensor`` may return an ``AsyncCollectiveTensor`` whose collective is still in flight; a rank that
    drops it unread (the export's and the self-check's non-writing ranks) would leave gloo work pending when the
    process group is destroyed, which aborts the process at exit ("terminate called without an active exception").
    A plain tensor is returned as it is."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return t
    # One all-gather per mesh dimension, outermost first: what torch does for expert parallelism's (edp, ep) layout
    # too, but with a warning per tensor.
    for dim in range(t.device_mesh.ndim):
        t = t.redistribute(t.device_mesh, [Replicate() if i <= dim else p for i, p in enumerate(t.placements)])
    full = t.to_local()
    return full.wait() if isinstance(full, AsyncCollectiveTensor) else full
