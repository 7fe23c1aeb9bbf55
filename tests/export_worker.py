"""One rank of the 2-rank export test (``test_export.py``), launched by torchrun over gloo.

``$EXPORT_CASES`` is a JSON list of ``{"src", "out", "max_shard_size", "measure"}``. For each case every rank builds
the checkpoint's model the trainer's way (meta -> ``fully_shard`` -> materialize -> read its own slices), then
exports it with ``export_hf``. With ``measure``, rank 0 also records the host peak (VmHWM above VmRSS at the start,
after resetting the high-water mark) of the streamed export and of the old path (``get_model_state_dict`` with
``full_state_dict=True``: the whole fp32 state on rank 0), into ``<out>.peaks.json``.
"""

from __future__ import annotations

import gc
import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from vlm_sft.checkpoint.export import export_hf
from vlm_sft.checkpoint.hf_dir import CheckpointIndex
from vlm_sft.checkpoint.load import load_model_config, load_weights, materialize, meta_model
from vlm_sft.model.backends import resolve_backends
from vlm_sft.parallel.env import DistEnv
from vlm_sft.parallel.parallelize import shard_model


def _status_mib(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M)[1]) / 1024


def _start_peak() -> float:
    """Resets the RSS high-water mark (``clear_refs`` 5, Linux >= 4.0); returns the RSS it starts from, in MiB."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mib("VmRSS")


def _peak_above(start: float) -> float:
    return _status_mib("VmHWM") - start


def sharded_model(src: str, env: DistEnv):
    index = CheckpointIndex.open(src)
    model = meta_model(load_model_config(src), resolve_backends(env.device))
    shard_model(model, env)
    assert all(isinstance(p, DTensor) for p in model.parameters())  # the export gathers every tensor
    materialize(model, env.device)
    load_weights(model, index)
    return model, index


def main() -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    env = DistEnv(rank=rank, world_size=size, local_rank=rank, device=torch.device("cpu"))
    for case in json.loads(os.environ["EXPORT_CASES"]):
        model, index = sharded_model(case["src"], env)
        start = _start_peak()
        export_hf(model, case["out"], env=env, source=index, max_shard_size=case["max_shard_size"])
        streamed = _peak_above(start)
        if case["measure"]:
            start = _start_peak()
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            gathered = _peak_above(start)
            del state
            if env.is_main:
                with open(case["out"] + ".peaks.json", "w") as f:
                    json.dump({"streamed_mib": streamed, "full_state_dict_mib": gathered}, f)
        del model
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from vlm_sft.parallel.env import end_process

    end_process(0)  # as the CLI ends a process of a multi-process run: the interpreter's teardown can abort (gloo)
