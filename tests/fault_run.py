"""Runs ``vlm_sft/train.py``'s CLI (``cli``: its one exit path) with a planted fault, for the failure-exit tests.

Launched like the entry point (``python tests/fault_run.py --config ...``, or under torchrun). ``$VLM_SFT_FAULT``:

- unset: nothing planted;
- ``inf_loss:STEP:RANK``: an inf added to the first training forward's loss of step STEP on rank RANK (one
  micro-batch per step, no eval); its gradients stay finite, so only the step's agreement tells the other ranks;
- ``config_error``: a ``ConfigError`` raised once the data workers have started (where the eval batches are built).

Every process prints ``TEARDOWN_MARKER`` from an ``atexit`` handler: the interpreter's teardown ran, which a process of a
multi-process run must skip (``parallel.env.end_process``: on gloo the teardown can abort with SIGABRT).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import sys
from pathlib import Path

TEARDOWN_MARKER = "fault_run: interpreter teardown ran"


def plant(fault: str) -> None:
    """Patch the trainer for ``fault`` (module docstring)."""
    if fault.startswith("inf_loss:"):
        from vlm_sft.model.vlm import Qwen3_5VLM

        step, rank = (int(v) for v in fault.split(":")[1:])
        forward, calls = Qwen3_5VLM.forward, [0]

        def planted(self, *args, **kwargs):
            out = forward(self, *args, **kwargs)
            if self.training and kwargs.get("target_ids") is not None:
                calls[0] += 1
                if calls[0] == step and int(os.environ.get("RANK", "0")) == rank:
                    return dataclasses.replace(out, loss_sum=out.loss_sum + float("inf"))
            return out

        Qwen3_5VLM.forward = planted
    elif fault == "config_error":
        from vlm_sft.config import ConfigError
        from vlm_sft.trainer import setup

        def refuse(*args, **kwargs):
            raise ConfigError("planted: a setting refused after the data workers started (tests/fault_run.py)")

        setup.build_eval_batches = refuse
    elif fault:
        raise ValueError(f"unknown VLM_SFT_FAULT {fault!r}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    # Ctrl-C as at a terminal, however pytest was started: a suite run in the background of a script (``cmd &``)
    # ignores SIGINT, its children inherit that, and Python then never turns SIGINT into KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit.register(lambda: print(TEARDOWN_MARKER, file=sys.stderr, flush=True))
    from vlm_sft.train import cli

    plant(os.environ.get("VLM_SFT_FAULT", ""))
    cli(sys.argv[1:])
