"""Runs ``vlm_sft/train.py`` in this process with torch.distributed's collectives counted (for test_distributed.py).

Launched like the entry point (``torchrun ... tests/collective_probe.py --config ...``). Every collective FSDP2 and
the trainer call goes through a ``torch.distributed`` function looked up at call time, so wrapping those functions
here counts them all. Writes ``rank<R>.json`` (calls per function, and the device types of the tensors handed to
the trainer's own all-reduces) into ``$PROBE_OUT``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

COUNTED = ("reduce_scatter_single", "all_gather_into_tensor", "all_reduce", "all_gather_object", "barrier")
counts: dict[str, int] = {}
devices: set[str] = set()


def _counting(name: str, fn):
    def wrapper(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        if name == "all_reduce" and args and isinstance(args[0], torch.Tensor):
            devices.add(args[0].device.type)
        return fn(*args, **kwargs)

    return wrapper


for _name in COUNTED:
    setattr(dist, _name, _counting(_name, getattr(dist, _name)))

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from vlm_sft.train import main

    code = main(sys.argv[1:])
    out = Path(os.environ["PROBE_OUT"]) / f"rank{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps({"counts": counts, "all_reduce_devices": sorted(devices)}))
    from vlm_sft.parallel.env import end_process

    end_process(code)  # as the CLI ends a process of a multi-process run: no interpreter teardown (it can abort)
