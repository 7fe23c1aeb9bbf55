"""Where this process sits in the job: the process group, the device, and leaving both at the end.

accelerate (or torchrun) launches and sets RANK / WORLD_SIZE / LOCAL_RANK; sharding is ours (``parallel.fsdp``,
``fully_shard`` on a device mesh), so CPU (gloo) and CUDA (NCCL) take one code path: accelerate's own FSDP plugin
does not shard on the CPU.

- **Which device serves which collective**: NCCL serves CUDA tensors only, so on CUDA the group is
  ``cpu:gloo,cuda:nccl``: FSDP's and context parallelism's collectives on the GPU, the trainer's own small ones
  (``parallel.collectives``) on gloo.
- **Elastic restarts**: under the elastic agent's TCP store every attempt joins under its own key prefix,
  ``vlm_sft/attempt<TORCHELASTIC_RESTART_COUNT>`` (``join_store``; the first attempt too, so every run takes the path
  a restart takes); through torch's default join a restarted worker could read the dead attempt's addresses and wait
  out the group's 10-minute timeout. One node only: multi-node jobs set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and
  take the default path. What was seen, and the recipe: docs/cluster.md, "Elastic restarts".
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

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
        """More than one process: collectives are real."""
        return self.world_size > 1

    @property
    def sharded(self) -> bool:
        """The model is wrapped by FSDP2: with several processes, and on CUDA always (one GPU too), so bf16 runs
        get FSDP's mixed precision (bf16 compute over fp32 master weights) on one GPU exactly as on many."""
        return self.distributed or self.device.type == "cuda"


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


RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
"""Set by torchelastic (torchrun, accelerate's multi-process launch) in every worker: the restarts so far."""
ATTEMPT_PREFIX = "vlm_sft/attempt{}"
"""Key prefix of one elastic attempt in the agent's store (module docstring)."""


def elastic_restart() -> int | None:
    """How many times the elastic agent restarted this job's workers (0 on the first attempt); None when the process
    was not started by an elastic agent (``python``, a scheduler's own launcher, ``accelerate launch`` of one
    process)."""
    count = os.environ.get(RESTART_COUNT)
    return None if count is None else int(count)


def join_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """The store this attempt joins the process group through: under an elastic agent that shares its store, the
    agent's store under this attempt's prefix; otherwise None (torch's default ``env://`` join)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(ATTEMPT_PREFIX.format(elastic_restart() or 0), agent)


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
        timeout = timedelta(seconds=timeout_s)
        kwargs: dict = {"timeout": timeout}
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            kwargs |= {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        elif (store := join_store(world_size, timeout)) is not None:
            kwargs |= {"store": store, "rank": rank, "world_size": world_size}
        dist.init_process_group(backend=backend, **kwargs)
        restart = elastic_restart()
        logger.info(
            "rank %d/%d joined the process group (%s) on %s%s", rank, world_size, backend, device,
            f" (elastic attempt {restart})" if restart else "",
        )  # fmt: skip
    return env


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


def end_children(wait_s: float = 5.0) -> None:
    """Kill the child processes this process started through multiprocessing that are still alive (data workers an
    error left behind; a run ends its own, ``TrainBatches.close``), and reap them: no exit may wait for them, and
    multiprocessing's exit handler would join them without a timeout."""
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.kill()
    for child in children:
        child.join(wait_s)


def end_process(code: int) -> NoReturn:
    """End a process of a multi-process run with ``code``, without the interpreter's teardown.

    A finished run on gloo could abort in the C++ destructors that run while the interpreter finalizes (SIGABRT after
    its last line of Python, so its launcher reported a failure): every file is closed by then, so this flushes the
    log handlers, stdout and stderr and leaves with ``os._exit``. Only the CLI calls it, never ``train()`` (a caller
    in the same process keeps its interpreter). How often it struck: docs/cluster.md, "Every exit ends its data
    workers and has its code"."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
