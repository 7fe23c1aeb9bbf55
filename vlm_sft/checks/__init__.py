"""Checks a user runs before spending GPU hours, in one room.

- ``packing_check``: is packing exact for this model and these backends? Each sample alone vs packed, against the
  float32 noise floor of the same computation (``noise_floor``), forward and backward.
- ``slice``: a few layers of the (sharded) model, gathered whole, so the start-up self-check costs seconds on any
  model size; ``self_check`` runs the packing check on it with the run's own data (``train.check_packing``,
  ``python -m vlm_sft.check_packing``).
- ``memory_plan``: what a run will hold per rank (estimates, ``python -m vlm_sft.checks.memory_plan``; its
  activation and expert-dispatch terms are ``activations``'s, its parameter counts ``model_counts``'s);
  ``memory_report``: the ``--dry-run`` table of measured peaks beside that plan.

Submodules are imported by name, so importing the package is light.
"""
