"""How the model and the data are spread over ranks, in one room: the only package that imports ``torch.distributed``.

Read in this order:

- ``env``: where this process sits in the job (rank, world size, device) and the process group's backends.
- ``mesh``: the job's ranks as one device mesh with named dimensions (``dp``, ``cp``; expert parallelism joins as one
  more), and this rank's place in it.
- ``parallelize``: the one entry that spreads a model over the mesh (LoRA, activation checkpointing, context
  parallelism, FSDP2, in that order); the only code that knows the model's module paths.
- ``fsdp``: FSDP2 units, gradient sync, and the row rule every reader and writer of a shard uses.
- ``context_parallel``: Ulysses all-to-alls around the token mixers (the data plane: device tensors).
- ``collectives``: the trainer's own host-tensor collectives and their failure agreement (the control plane).
- ``dcp``: sharded model and optimizer state in and out of torch distributed checkpoint, reading no pickle.

Submodules are imported by name (``from vlm_sft.parallel.collectives import all_reduce``), so importing the package
is light.
"""
