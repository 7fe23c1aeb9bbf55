"""Which rows of a tensor this rank holds: the one rule every reader and writer of FSDP2 shards uses.

FSDP2 places every parameter as ``Shard(0)`` over a 1-D mesh, in ``torch.chunk`` pieces: the first ranks hold
``ceil(n / W)`` rows, the last ones fewer or none. The sharded checkpoint load (each rank reads its rows), the LoRA
init (each rank keeps its rows of one draw) and the self-check's slice (each rank contributes its rows) all need
that range; a plain tensor is held whole, a replicated DTensor too.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard


def local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(local tensor, first row, end row)`` of ``t`` on dim 0 for this rank (all rows of a plain or replicated
    tensor). Any other layout is refused: filling it with the wrong rows would be silent."""
    if not isinstance(t, DTensor):
        return t, 0, (t.shape[0] if t.dim() else 0)
    local = t.to_local()
    if all(isinstance(p, Replicate) for p in t.placements):
        return local, 0, (t.shape[0] if t.dim() else 0)
    if t.device_mesh.ndim != 1 or t.placements != (Shard(0),):
        raise NotImplementedError(f"only FSDP2's Shard(0) over a 1-D mesh is supported, got placements {t.placements}")
    n, world = t.shape[0], t.device_mesh.size()
    chunk = -(-n // world)
    start = min(t.device_mesh.get_local_rank() * chunk, n)
    stop = min(start + chunk, n)
    assert local.shape[0] == stop - start, f"local shard has {local.shape[0]} rows, expected {stop - start}"
    return local, start, stop
