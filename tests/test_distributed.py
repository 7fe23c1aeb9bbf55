"""The collective rules of ``vlm_sft/parallel/`` (``env.py``, ``collectives.py``), held on the CPU.

1. The process group serves what it is handed: on CUDA it is ``cpu:gloo,cuda:nccl`` (NCCL alone refuses CPU
   tensors, which crashed every multi-GPU run at its first step); checked by building the group on a machine made to
   look like CUDA.
2. The trainer's own collectives take host tensors, and only the ``parallel`` package calls ``torch.distributed``: a
   device tensor handed to a helper is refused (a meta tensor stands in for a GPU one), and a source scan fails on any
   new direct collective elsewhere in the package. A 2-rank run records the device of every all-reduce the trainer made.
3. Gradients are reduce-scattered once per step, not once per micro-batch (counted in 2-rank runs).
4. A failure on one rank stops every rank promptly, with the message printed once (two plain processes, as a
   cluster scheduler starts them: no torchrun to kill the survivor).
"""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from train_helpers import TRAIN_SCRIPT, launch_env, run_training, tiny_run_args

import vlm_sft.parallel.env as distributed
from vlm_sft.config import REPO_ROOT
from vlm_sft.model import tiny_qwen3_5_config
from vlm_sft.parallel.collectives import PeerFailure, all_reduce, check_peers
from vlm_sft.parallel.env import DistEnv

PROBE = str(Path(__file__).with_name("collective_probe.py"))
FAULT_RUN = str(Path(__file__).with_name("fault_run.py"))
"""The CLI with a marker printed if the interpreter's teardown runs (and no fault planted here)."""
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "all_to_all",
    "all_to_all_single", "gather", "scatter", "reduce", "send", "recv", "all_to_all_single_autograd",
    "all_gather_single_autograd",
}  # fmt: skip


# ------------------------------------------------------------------------------------ 1. the backend map


@pytest.fixture
def group_calls(monkeypatch) -> list[dict]:
    """A machine that looks like it has CUDA; records the arguments of every process-group creation."""
    calls: list[dict] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    return calls


def test_cuda_process_group_serves_cpu_and_cuda_tensors(monkeypatch, group_calls):
    """On a CUDA machine the group must have a CPU backend too: the trainer reduces host tensors."""
    calls = group_calls
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    env = distributed.init_distributed("auto")
    assert env.device == torch.device("cuda", 3) and env.sharded
    assert [c["backend"] for c in calls] == ["cpu:gloo,cuda:nccl"]


def test_one_gpu_gets_a_one_rank_group_and_the_cpu_none(monkeypatch, group_calls):
    """One GPU is sharded too (FSDP's bf16 mixed precision); a single CPU process has no group at all."""
    calls = group_calls
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    env = distributed.init_distributed("auto")
    assert env.sharded and calls[0]["world_size"] == 1 and calls[0]["backend"] == "cpu:gloo,cuda:nccl"
    calls.clear()
    assert not distributed.init_distributed("cpu").sharded and not calls


# ------------------------------------------------------------------------- 2. host tensors, one module


def test_helpers_refuse_device_tensors():
    env = DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    on_device = torch.zeros(2, device="meta")  # stands in for a CUDA tensor: anything that is not host memory
    with pytest.raises(ValueError, match="host"):
        all_reduce(on_device, env)
    with pytest.raises(ValueError, match="host"):
        check_peers(env, "testing", values=on_device)


def test_check_peers_single_process_sums_and_reraises():
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    assert check_peers(env, "testing", values=torch.tensor([2.0, 3.0])).tolist() == [2.0, 3.0]
    with pytest.raises(KeyError, match="boom"):
        check_peers(env, "testing", KeyError("boom"))
    assert "rank 1 failed while saving" in str(PeerFailure("saving", {1: "OSError: disk full"}))


def _direct_collective_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed", "c10d", "fc"):
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {owner}.{node.func.attr}")
    return found


PARALLEL = REPO_ROOT / "vlm_sft" / "parallel"
DATA_PLANE = PARALLEL / "context_parallel.py"
"""Context parallelism's all-to-alls and feature gather: device tensors (the activations), like FSDP's."""


def test_only_the_parallel_package_calls_collectives():
    """A collective written anywhere else could hand NCCL a CPU tensor (or skip the failure agreement): the host
    collectives are ``parallel/collectives.py``'s, the data plane ``parallel/context_parallel.py``'s."""
    offenders = []
    for path in sorted((REPO_ROOT / "vlm_sft").rglob("*.py")):
        if PARALLEL not in path.parents:
            offenders += _direct_collective_calls(path)
    assert not offenders, offenders
    assert _direct_collective_calls(PARALLEL / "collectives.py")  # the scan sees calls
    assert _direct_collective_calls(DATA_PLANE)


def test_bf16_runs_compute_in_bf16_over_fp32_master_weights():
    """FSDP2 mixed precision (what a bf16 run gets on CUDA, one GPU or many): layers see bf16 weights and compute
    in bf16, while parameters, gradients and AdamW state stay fp32; the loss stays within bf16 noise of fp32."""
    from test_host_syncs import _batch

    from vlm_sft.model import build_model
    from vlm_sft.parallel.parallelize import shard_model

    torch.manual_seed(0)
    reference = build_model(tiny_qwen3_5_config(), freeze_vision=False)
    model = build_model(tiny_qwen3_5_config(), freeze_vision=False)
    model.load_state_dict(reference.state_dict())
    batch = _batch()
    distributed.dist.init_process_group("cpu:gloo", store=distributed.dist.HashStore(), rank=0, world_size=1)
    try:
        sharded_env = SimpleNamespace(sharded=True, device=torch.device("cpu"), world_size=1)
        model = shard_model(model, sharded_env, param_dtype=torch.bfloat16)
        seen = []
        mlp = model.model.language_model.layers[0].mlp.gate_proj
        mlp.register_forward_hook(lambda m, args, out: seen.append((m.weight.dtype, out.dtype)))
        loss = model(**batch.model_kwargs()).loss_sum
        loss.backward()
        optimizer = torch.optim.AdamW(model.parameters())
        optimizer.step()
    finally:
        distributed.dist.destroy_process_group()
    expected = reference(**batch.model_kwargs()).loss_sum
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}
    assert {v.dtype for state in optimizer.state.values() for v in state.values() if v.dim()} == {torch.float32}
    assert float(loss) != float(expected) and abs(float(loss) - float(expected)) <= 1e-3 * float(expected)


# ---------------------------------------------------------- 3. gradient reduction once per step (2 ranks)


def _probe(tmp: Path, grad_sync: str) -> list[dict]:
    out = tmp / f"probe-{grad_sync}"
    out.mkdir()
    args = tiny_run_args(out, **{"train.micro_batches": 3, "train.max_steps": 2, "train.grad_sync": grad_sync})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", PROBE, *args]
    env = launch_env() | {"PROBE_OUT": str(out)}
    proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_gradients_are_reduced_once_per_step(tmp_path):
    """2 steps of 3 micro-batches: each FSDP unit with gradients reduce-scatters once per step by default, and after
    every micro-batch only when asked (``train.grad_sync = "micro_batch"``, for gradients too big to hold whole).
    Both runs' control-plane all-reduces got host tensors only."""
    per_step, per_micro = _probe(tmp_path, "step"), _probe(tmp_path, "micro_batch")
    units = tiny_qwen3_5_config().text_config.num_hidden_layers + 2  # decoder layers, the vision tower, the root
    for a, b in zip(per_step, per_micro, strict=True):
        assert a["counts"]["reduce_scatter_single"] == 2 * units
        assert b["counts"]["reduce_scatter_single"] == 2 * 3 * units
        assert a["all_reduce_devices"] == b["all_reduce_devices"] == ["cpu"]
    assert per_step[0]["counts"]["all_reduce"] == per_micro[0]["counts"]["all_reduce"]


# --------------------------------------------------------------------- 4. one rank fails, all stop


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_failure_on_one_rank_stops_every_rank_with_the_message_once(tmp_path):
    """Rank 1 cannot read its part of the checkpoint to resume from (its RNG state); rank 0 can. Without the
    agreement rank 0 would walk into the checkpoint's collectives alone and wait (on NCCL: until the 10-minute
    timeout). Both leave through the CLI's one exit path, which skips the interpreter's teardown: rank 1's error
    used to end in that teardown, which aborted now and then (SIGABRT, -6, instead of 1; ``fault_run.py`` prints a
    marker when the teardown runs)."""
    from fault_run import TEARDOWN_MARKER

    from vlm_sft.checkpoint.state import TRAINER_STATE, capture_rng, data_file, rng_file, write_rng

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "COMPLETE").write_text("step 3, world size 2\n")
    state = {"format": 1, "step": 3, "world_size": 2, "scheduler": {}, "param_groups": [], "extra": {}}
    (ckpt / TRAINER_STATE).write_text(json.dumps(state))
    for rank in (0, 1):
        (ckpt / data_file(rank)).write_text("{}")
    write_rng(ckpt / rng_file(0), capture_rng())
    (ckpt / rng_file(1)).write_bytes(b"damaged")
    args = tiny_run_args(tmp_path, **{"train.resume": str(ckpt)})
    port = _free_port()
    procs = []
    start = time.monotonic()
    for rank in (0, 1):
        env = launch_env() | {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        }  # fmt: skip
        cmd = [sys.executable, FAULT_RUN, *args]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = [p.communicate(timeout=120) for p in procs]
    elapsed = time.monotonic() - start
    err = [e.decode() for _, e in outputs]
    assert [p.returncode for p in procs] == [1, 1], err
    assert "stopped: rank 1 failed while opening the checkpoint" in err[0]
    assert (err[0] + err[1]).count("rng-rank00001.safetensors is not an RNG state file") == 1, err
    assert TEARDOWN_MARKER not in err[0] + err[1], err
    assert elapsed < 60, elapsed  # start-up included; the failure itself ends both ranks at once


def test_launchers_see_the_probe_and_entry_point():
    assert Path(TRAIN_SCRIPT).is_file() and Path(PROBE).is_file() and "RANK" not in launch_env()
    assert callable(run_training)
    assert os.path.basename(PROBE) == "collective_probe.py"


def test_end_process_flushes_and_exits_with_the_code():
    """``end_process`` leaves without the interpreter's teardown (the abort after finished multi-process runs); what
    Python still buffers (a log record, unflushed stdout / stderr) must come out first, and the code is the run's."""
    script = (
        "import logging, sys\n"
        "from vlm_sft.parallel.env import end_process\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "logging.getLogger('run').info('logged before the end')\n"
        "sys.stdout.write('printed, not flushed'); sys.stderr.write('to stderr, not flushed')\n"
        "end_process(3)\n"
        "print('never reached')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as a launched run's output
    proc = subprocess.run(  # stdout to a pipe: block-buffered, so only the flush can get the line out
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "printed, not flushed"
    assert "logged before the end" in proc.stderr and "to stderr, not flushed" in proc.stderr
