"""The job's ranks as one device mesh with named dimensions: which ranks share a row, which share the data.

Ranks are laid out row-major over the named dimensions, outermost first:

- ``dp`` (data parallel): ranks that read different rows of the global batch (``trainer.batches.DataLayout`` deals
  the data streams by this rank's ``dp_rank`` of ``dp_size``).
- ``cp`` (context parallel, ``train.cp_size``): ``cp`` consecutive ranks (one node's GPUs, where the all-to-alls are
  fast) hold the same row and each computes ``1 / cp`` of its tokens (``parallel.context_parallel``).
- ``ep`` (expert parallel, ``train.ep_size``), carved out of ``dp``: ``ep`` consecutive data-parallel ranks split
  every MoE layer's routed experts and send each token to its experts (``parallel.expert_parallel``); ``edp`` is the
  rest of ``dp``: the ranks that hold the same experts. With expert parallelism the mesh is ``(edp, ep)``.

FSDP2 shards every parameter over all the ranks of the mesh (the dimensions flattened into one, ``fsdp_mesh``); the
trainer's loss scale turns FSDP's average over every rank into the sum that a CP group's gradients need. Expert
parallelism's experts are the exception: split over ``ep``, then FSDP2-sharded over ``edp`` alone. A dimension of
size 1 is left out of the device mesh, as torchtitan does, except ``edp`` under expert parallelism (the experts' FSDP2
mesh, of one rank when ``ep_size`` is the world size).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from vlm_sft.config import ConfigError
from vlm_sft.parallel.context_parallel import NO_CP, ContextParallel
from vlm_sft.parallel.env import DistEnv
from vlm_sft.parallel.expert_parallel import ExpertParallel

logger = logging.getLogger(__name__)

DP = "dp"
"""The data-parallel dimension's name in the device mesh."""
CP = "cp"
"""The context-parallel dimension's name."""
EP = "ep"
"""The expert-parallel dimension's name."""
EDP = "edp"
"""Under expert parallelism, the rest of data parallelism: the ranks that hold the same experts."""


@dataclass(frozen=True)
class ParallelDims:
    """How many ranks each dimension takes; their product is the world size."""

    dp: int
    """Data-parallel ranks: the world size over the other dimensions."""
    cp: int = 1
    """Context-parallel ranks per row (``train.cp_size``)."""
    ep: int = 1
    """Expert-parallel ranks per group (``train.ep_size``), a divisor of ``dp``."""

    @classmethod
    def for_world(cls, world_size: int, *, cp_size: int = 1, ep_size: int = 1) -> ParallelDims:
        """The dimensions of a job of ``world_size`` ranks; sizes that do not divide it are refused with the fix."""
        for name, size in (("cp_size", cp_size), ("ep_size", ep_size)):
            if size < 1 or world_size % size:
                raise ConfigError(
                    f"train.{name} = {size} does not divide the {world_size} ranks; launch a multiple of {size} "
                    f"processes or change {name}"
                )
        if cp_size > 1 and ep_size > 1:
            raise ConfigError("train.cp_size and train.ep_size are not combined yet; set one of them to 1")
        return cls(dp=world_size // cp_size, cp=cp_size, ep=ep_size)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    def named(self) -> tuple[tuple[str, int], ...]:
        """``(name, size)`` of every dimension of size > 1, outermost first (at least ``dp``; under expert
        parallelism ``edp`` and ``ep``, whatever their sizes)."""
        if self.ep > 1:
            return ((EDP, self.dp // self.ep), (EP, self.ep))
        return tuple((n, s) for n, s in ((DP, self.dp), (CP, self.cp)) if s > 1) or ((DP, self.dp),)


@dataclass(frozen=True)
class ParallelMesh:
    """This rank's place in the mesh, and the groups its collectives use."""

    dims: ParallelDims
    dp_rank: int
    """Which rows of the global batch this rank reads (its CP group's index)."""
    cp: ContextParallel
    """This rank's context-parallel group (``NO_CP`` without context parallelism)."""
    ep: ExpertParallel | None
    """This rank's expert-parallel group (None without expert parallelism)."""
    device_mesh: DeviceMesh | None
    """The named mesh (None: one process on the CPU, nothing sharded)."""
    fsdp_mesh: DeviceMesh | None
    """Every rank of ``device_mesh`` in one dimension: what FSDP2 shards over (None: not sharded)."""

    @property
    def dp_size(self) -> int:
        return self.dims.dp


def build_mesh(env: DistEnv, *, cp_size: int = 1, ep_size: int = 1) -> ParallelMesh:
    """The mesh of ``env``'s job for ``train.cp_size`` and ``train.ep_size`` (a collective: every rank calls it, in
    the same order)."""
    dims = ParallelDims.for_world(env.world_size, cp_size=cp_size, ep_size=ep_size)
    if not env.sharded:  # one CPU process: nothing to shard, no group to build
        return ParallelMesh(dims, 0, NO_CP, None, None, None)
    names, sizes = zip(*dims.named(), strict=True)
    mesh = init_device_mesh(env.device.type, sizes, mesh_dim_names=names)
    fsdp = mesh if len(names) == 1 else mesh[names]._flatten("_".join(names))
    cp = NO_CP
    if dims.cp > 1:
        cp = ContextParallel(group=mesh.get_group(CP), rank=mesh.get_local_rank(CP), size=dims.cp)
    ep = None
    if dims.ep > 1:
        ep = ExpertParallel(mesh[EP], mesh.get_local_rank(EP), dims.ep, mesh[EDP], env.world_size)
        dp_rank = fsdp.get_local_rank()  # every rank reads its own rows: (edp, ep) flattened
    else:
        dp_rank = mesh.get_local_rank(DP) if dims.dp > 1 else 0
    logger.info("mesh %s: this rank is dp rank %d, cp rank %d", dict(dims.named()), dp_rank, cp.rank)
    return ParallelMesh(dims, dp_rank, cp, ep, mesh, fsdp)
