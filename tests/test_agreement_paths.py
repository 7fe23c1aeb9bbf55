"""Paths where one rank could fail outside the run's failure agreement, or leave a wrong file or message behind
(issue 44), each held in process by the case that failed before its fix:

- ``next_step_batches``: the counts (FLOPs, the data accounting, the CP shard counts) are inside the agreement, with
  the all-reduce's width kept, so a rank that fails there still joins its peers' all-reduce.
- ``check_peers``: when its own all-reduce fails, this rank's error is raised, the collective's failure chained.
- The failure board's watcher keeps watching through a store error (logged), and still stops the rank.
- ``TrainBatches.close`` / ``end_workers``: a stuck data worker that ignores SIGTERM is ended within seconds.
- The CLI: every outcome leaves through one path with its code (``cli``).
- ``python -O`` keeps every check: no ``assert`` in ``parallel`` and ``trainer``; the context-parallel decode guard, the
  FSDP row rule and the data layout raise named errors.
"""

from __future__ import annotations

import ast
import logging
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from test_host_syncs import _batch
from torch.utils.data import DataLoader, IterableDataset

import vlm_sft.train as cli_module
from vlm_sft.config import REPO_ROOT
from vlm_sft.parallel import collectives, failure
from vlm_sft.parallel import env as distributed
from vlm_sft.parallel.env import DistEnv
from vlm_sft.parallel.failure import FailureBoard, agreed
from vlm_sft.trainer import step_batches
from vlm_sft.trainer.batches import DataLayout, end_workers
from vlm_sft.trainer.preemption import data_worker_init

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
TWO = DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))


# ------------------------------------------------------------------------------------- the step's all-reduce


class _Accounting:
    width = 4

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def local_values(self) -> list[float]:
        if self.fail:
            raise OSError("the accounting's file system went away")
        return [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("where", ["flops", "accounting", "shard_counts"])
def test_a_failure_in_the_step_counts_goes_through_the_agreement(monkeypatch, where):
    seen = []

    def recording(env, what, error=None, values=None):
        seen.append((error, values.shape))
        return real(env, what, error, values)

    def broken(*args, **kwargs):
        raise ValueError(f"{where} failed on this rank")

    real = step_batches.check_peers
    monkeypatch.setattr(step_batches, "check_peers", recording)
    monkeypatch.setattr(step_batches, "batch_flops", lambda *args, **kwargs: SimpleNamespace(train=1.0))
    model = SimpleNamespace(config=None, vision_trainable=True)
    step_batches.next_step_batches(iter([_batch()]), 1, CPU, model, _Accounting(False))
    assert seen[0][0] is None
    if where in ("flops", "shard_counts"):
        monkeypatch.setattr(step_batches, {"flops": "batch_flops"}.get(where, where), broken)
    with pytest.raises((ValueError, OSError)) as info:
        step_batches.next_step_batches(iter([_batch()]), 1, CPU, model, _Accounting(where == "accounting"))
    assert seen[1][0] is info.value and agreed(info.value)  # told to every rank in the step's all-reduce
    assert seen[1][1] == seen[0][1]  # with as many values as a healthy rank sends


# ------------------------------------------------------------------------------------------ check_peers


def test_a_failed_agreement_keeps_this_ranks_error_with_the_collectives_chained(monkeypatch):
    def peer_gone(value, env):
        raise RuntimeError("[gloo] Connection closed by peer")

    monkeypatch.setattr(collectives, "all_reduce_sum", peer_gone)
    mine = ValueError("rng-rank00001.safetensors is not an RNG state file")
    with pytest.raises(ValueError) as info:
        collectives.check_peers(TWO, "opening the checkpoint", mine)
    assert info.value is mine and isinstance(mine.__cause__, RuntimeError)
    assert "telling the other ranks failed too: RuntimeError: [gloo] Connection closed by peer" in mine.__notes__[0]
    with pytest.raises(RuntimeError, match="Connection closed"):  # a rank without an error of its own: unchanged
        collectives.check_peers(TWO, "opening the checkpoint")


# ---------------------------------------------------------------------------------------- failure board


class _FlakyStore:
    """A store whose first ``misses`` requests time out, holding a failure posted by rank 1."""

    def __init__(self, misses: int) -> None:
        self.misses = misses

    def add(self, key: str, value: int) -> int:
        if self.misses > 0:
            self.misses -= 1
            raise RuntimeError("Socket Timeout")
        return 1

    def check(self, keys: list[str]) -> bool:
        return keys == ["rank1"]

    def get(self, key: str) -> bytes:
        return b"training step 7: RuntimeError: CUDA error"


def test_the_watcher_keeps_watching_through_a_store_timeout(monkeypatch, caplog):
    stopped = threading.Event()
    monkeypatch.setattr(failure, "_stop_process", lambda rank, failed, message: stopped.set())
    board = FailureBoard(_FlakyStore(misses=3), rank=0, world_size=2, poll_s=0.01)
    with caplog.at_level(logging.WARNING, logger=failure.__name__):
        board.start()
        try:
            assert stopped.wait(5), "the watcher gave up at the store's first timeout"
        finally:
            board.stop()
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("does not answer (RuntimeError: Socket Timeout)" in m for m in warnings) == 1, warnings  # once
    assert any("answers again" in m for m in warnings), warnings


# ----------------------------------------------------------------------------------------- data workers


class _Stuck(IterableDataset):
    """Yields one item, then blocks for good (a worker stuck on a file)."""

    def __iter__(self):
        yield torch.zeros(1)
        time.sleep(3600)


def test_a_stuck_worker_that_ignores_sigterm_is_ended_within_seconds():
    loader = iter(DataLoader(_Stuck(), batch_size=None, num_workers=1, worker_init_fn=data_worker_init))
    next(loader)
    worker = loader._workers[0]
    start = time.monotonic()
    end_workers(loader, wait_s=1.0)
    assert not worker.is_alive() and time.monotonic() - start < 10
    assert worker.exitcode == -signal.SIGKILL


# -------------------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize(
    ("raised", "code"),
    [(KeyboardInterrupt(), 130), (ValueError("a bug"), 1), (SystemExit(2), 2), (None, 0)],
    ids=["ctrl-c", "bug", "usage", "finished"],
)
@pytest.mark.parametrize("world", ["1", "2"])
def test_every_outcome_leaves_through_one_path_with_its_code(monkeypatch, capsys, raised, code, world):
    def main(argv=None):
        if raised is not None:
            raise raised
        return 0

    def end_process(exit_code: int):
        ended.append(exit_code)
        sys.exit(exit_code)

    ended = []
    monkeypatch.setattr(cli_module, "main", main)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setattr(distributed, "end_children", lambda: ended.append("children"))
    monkeypatch.setattr(distributed, "end_process", end_process)
    with pytest.raises(SystemExit) as info:
        cli_module.cli([])
    assert info.value.code == code
    assert ended == (["children", code] if world == "2" else ["children"])  # no interpreter teardown for W > 1
    err = capsys.readouterr().err
    assert ("Traceback" in err and "ValueError: a bug" in err) == (code == 1)
    assert ("interrupted (Ctrl-C)" in err) == (code == 130)


# ------------------------------------------------------------------------------------------- python -O


def test_no_assert_guards_the_parallel_and_trainer_code():
    """``python -O`` drops ``assert``: a check there must raise."""
    found = []
    for path in sorted(
        [*(REPO_ROOT / "vlm_sft" / "parallel").glob("*.py"), *(REPO_ROOT / "vlm_sft" / "trainer").glob("*.py")]
    ):
        found += [f"{path.name}:{n.lineno}" for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Assert)]
    assert not found, found


def test_the_checks_that_were_asserts_raise_named_errors():
    from vlm_sft.parallel.context_parallel import ContextParallelDecodeError, _attention_forward, _linear_attn_forward

    mixer = torch.nn.Identity()
    with pytest.raises(ContextParallelDecodeError, match="Identity got a decode cache while context parallelism"):
        _linear_attn_forward(mixer, None, None, None, None, cache=object())
    with pytest.raises(ContextParallelDecodeError):
        _attention_forward(mixer, None, None, None, None, None, None, cache=object())
    with pytest.raises(ValueError, match="data-parallel rank 2 of 2"):
        DataLayout(dp_rank=2, dp_size=2)


def test_the_fsdp_row_rule_refuses_a_shard_it_does_not_know():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from vlm_sft.parallel.fsdp import ShardLayoutError, local_rows

    distributed.dist.init_process_group("cpu:gloo", store=distributed.dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        good = DTensor.from_local(torch.zeros(4, 2), mesh, [Shard(0)])
        assert local_rows(good)[1:] == (0, 4)
        bad = DTensor.from_local(torch.zeros(3, 2), mesh, [Shard(0)], shape=torch.Size([4, 2]), stride=(2, 1))
        with pytest.raises(ShardLayoutError, match="3 rows where torch's offset rule gives rows 0:4"):
            local_rows(bad)
    finally:
        distributed.dist.destroy_process_group()
