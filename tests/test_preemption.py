"""A run survives the cluster: stop signals (``trainer/preemption.py``) and elastic restarts (``parallel/env.py``).

1. SIGTERM to a 1-process run, and to its data worker (a scheduler signals every process of the job): a checkpoint
   after the next step, exit code 143, and a resume from it gives the uninterrupted run's losses.
2. SIGTERM to one rank of a 2-process run (twice, as a scheduler and a launcher that forwards it would): both ranks
   save the same step, one checkpoint, and both exit 143.
3. ``torchrun --max-restarts 1 ... --train.resume latest`` with one worker SIGKILLed after the step-2 checkpoint: the
   restarted workers join (each attempt under its own prefix of the agent's store), resume and finish; the losses
   equal the uninterrupted run's and ``metrics.jsonl`` says where the restart resumed.
4. The handler itself: the repeat window, a second signal ending the process at once, SIGUSR1, data workers.

Every run is started in its own session and its whole process group is killed on the way out, so a hang (e.g. a
restarted worker that never joins) fails the test at its timeout instead of leaving processes behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from train_helpers import (
    TRAIN_SCRIPT,
    child_pids,
    deterministic,
    kill_process_tree,
    launch_env,
    read_metrics,
    tiny_run_args,
    train_command,
)

from vlm_sft.config import REPO_ROOT
from vlm_sft.trainer import preemption
from vlm_sft.trainer.preemption import PREEMPTED_EXIT_CODE, StopRequest, stop_signals

STEPS = 8
COMMON = {"train.max_steps": STEPS, "train.warmup_steps": 2, "data.shapes.num_train": 64}
"""Every run here draws the same global batch of 2 packs per step (2 micro-batches on 1 rank, or 1 on each of 2
ranks), so one uninterrupted 1-process run is the reference of all of them."""


class Job:
    """A command in its own session; ``kill`` ends all of it (launcher, workers in their own sessions, data workers)."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.out = tempfile.TemporaryFile("w+")  # noqa: SIM115 (read back by wait; files, so a full pipe never blocks)
        self.err = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, env=env or launch_env(), cwd=REPO_ROOT, stdout=self.out, stderr=self.err, text=True,
            start_new_session=True,
        )  # fmt: skip

    def wait(self, timeout: float) -> tuple[int, str, str]:
        """(exit code, stdout, stderr); past ``timeout`` the group is killed and the test fails with the output."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self._output()
            pytest.fail(f"no exit within {timeout} s (killed):\n{out[-2000:]}\n{err[-6000:]}")
        return (self.proc.returncode, *self._output())

    def _output(self) -> tuple[str, str]:
        for f in (self.out, self.err):
            f.seek(0)
        return self.out.read(), self.err.read()

    def kill(self) -> None:
        kill_process_tree(self.proc)


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    """Jobs a test starts; whatever still runs when it ends (a failed test) is killed with its process group."""
    started: list[Job] = []
    yield started
    for job in started:
        job.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Iterator[tuple[Job, Path]]:
    """The uninterrupted run, started in the background when the first test asks for it (it shares the cores with
    that test's own run); ``_reference_records`` waits for it."""
    tmp = tmp_path_factory.mktemp("reference")
    job = Job(train_command(tiny_run_args(tmp, **COMMON, **{"train.micro_batches": 2})))
    yield job, tmp / "run"
    job.kill()


def _reference_records(reference: tuple[Job, Path]) -> list[dict]:
    job, run_dir = reference
    code, _, err = job.wait(180)
    assert code == 0, err[-4000:]
    return deterministic(read_metrics(run_dir))


def _records(run_dir: Path) -> list[dict]:
    """``metrics.jsonl`` as far as it is written (a line being written may be cut)."""
    path = run_dir / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def _wait_for(predicate, job: Job, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if job.proc.poll() is not None:
            pytest.fail(f"the run ended ({job.proc.returncode}) before {what}:\n{job.wait(1)[2][-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout} s")
        time.sleep(0.02)


def _logged_step(run_dir: Path, step: int) -> bool:
    return any("loss" in r and r["step"] >= step for r in _records(run_dir))


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("step-*"))


def _assert_same_losses(got: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected] == list(range(1, STEPS + 1))
    for a, b in zip(got, expected, strict=True):
        assert (a["trainable_tokens"], a["real_tokens"], a["images"]) == (
            b["trainable_tokens"], b["real_tokens"], b["images"],
        ), a["step"]  # fmt: skip
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]


# ------------------------------------------------------------------------------------------ 1. one process


def test_sigterm_saves_after_the_next_step_and_the_resume_continues_exactly(tmp_path, reference, jobs):
    args = tiny_run_args(tmp_path, **COMMON, **{"train.micro_batches": 2, "data.num_workers": 1})
    run_dir = tmp_path / "run"
    victim = Job(train_command(args))
    jobs.append(victim)
    _wait_for(lambda: _logged_step(run_dir, 2), victim, "a metrics line of step 2")
    logged = max(r["step"] for r in _records(run_dir) if "loss" in r)
    workers = child_pids(victim.proc.pid)
    assert workers, "the run has a data worker process"
    for pid in [victim.proc.pid, *workers]:  # as a scheduler that signals every process of the job
        os.kill(pid, signal.SIGTERM)
    code, out, err = victim.wait(120)
    assert code == PREEMPTED_EXIT_CODE, err[-4000:]
    assert "got SIGTERM" in err
    [checkpoint] = _checkpoints(run_dir)
    saved = int(checkpoint.name.removeprefix("step-"))
    assert (checkpoint / "COMPLETE").is_file() and saved < STEPS
    # The step in progress, or the next one when the signal came after its all-reduce (one more: a step may have ended
    # between reading the metrics and the signal).
    assert logged < saved <= logged + 3
    records = _records(run_dir)
    assert max(r["step"] for r in records if "loss" in r) == saved  # saved at the step it stopped after
    assert records[-1] == {
        "step": saved, "event": "preempted", "signalled_ranks": 1, "checkpoint": str(checkpoint)
    }  # fmt: skip
    assert f"stopped at step {saved}" in out

    resumed = Job(train_command([*args, "--train.resume", "latest"]))
    jobs.append(resumed)
    code, _, err = resumed.wait(120)
    assert code == 0, err[-4000:]
    records = read_metrics(run_dir)
    assert {"step": saved, "event": "resumed", "from": str(checkpoint)} in records
    _assert_same_losses(deterministic(records), _reference_records(reference))


# ----------------------------------------------------------------------------------------- 2. two processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path, jobs):
    """Two plain processes, as a scheduler's own launcher (``srun``) starts them: only rank 1 gets the signal."""
    run_dir = tmp_path / "run"
    args = tiny_run_args(tmp_path, **COMMON)
    port = _free_port()
    ranks = []
    for rank in (0, 1):
        env = launch_env() | {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        }  # fmt: skip
        ranks.append(Job([sys.executable, TRAIN_SCRIPT, *args], env))
    jobs.extend(ranks)
    _wait_for(lambda: _logged_step(run_dir, 2), ranks[0], "a metrics line of step 2")
    for _ in range(2):  # the same request twice: the second is not "a second signal" (preemption.REPEAT_WINDOW_S)
        os.kill(ranks[1].proc.pid, signal.SIGTERM)
    results = [job.wait(120) for job in ranks]
    assert [code for code, _, _ in results] == [PREEMPTED_EXIT_CODE] * 2, results[0][2][-3000:] + results[1][2][-3000:]
    assert "rank 1: got SIGTERM" in results[1][2] and "got SIGTERM" not in results[0][2]
    [checkpoint] = _checkpoints(run_dir)  # one save, written by both ranks together
    assert (checkpoint / "COMPLETE").is_file()
    assert (checkpoint / "data-rank00000.json").is_file() and (checkpoint / "data-rank00001.json").is_file()
    saved = int(checkpoint.name.removeprefix("step-"))
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == saved < STEPS
    last = _records(run_dir)[-1]
    assert last == {"step": saved, "event": "preempted", "signalled_ranks": 1, "checkpoint": str(checkpoint)}


# ------------------------------------------------------------------------------------------ 3. elastic restart


LATE_RANK = """
import os, time
if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "1" and os.environ.get("RANK") == "1":
    time.sleep(3)
"""
"""``sitecustomize`` of the elastic test's workers: rank 1 of the restarted attempt starts 3 s after rank 0."""


def test_torchrun_restart_resumes_from_the_latest_checkpoint(tmp_path, reference, jobs):
    """Without a key prefix per attempt the restart joins only when both workers reach the store at the same moment
    (the bug was intermittent): rank 0, first, reads rank 1's address from the dead attempt and retries it until it
    fails or times out. So rank 1 of the restart starts late here, as a worker of a busy node does."""
    run_dir = tmp_path / "run"
    args = tiny_run_args(tmp_path, **COMMON, **{"train.resume": "latest", "train.save_every": 2})
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(LATE_RANK)
    env = launch_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    job = Job([*cmd, TRAIN_SCRIPT, *args], env)
    jobs.append(job)
    _wait_for(lambda: (run_dir / "checkpoints" / "step-000002" / "COMPLETE").is_file(), job, "the step-2 checkpoint")
    [victim] = [pid for pid in child_pids(job.proc.pid) if _environ(pid).get("RANK") == "1"]
    os.kill(victim, signal.SIGKILL)
    # Unfixed, the restarted workers wait in init_process_group for its 10-minute timeout: fail long before.
    code, _, err = job.wait(240)
    assert code == 0, err[-6000:]
    records = read_metrics(run_dir)
    [resumed] = [r for r in records if r.get("event") == "resumed"]
    assert resumed["restart"] == 1 and resumed["step"] >= 2
    assert resumed["from"] == str(run_dir / "checkpoints" / f"step-{resumed['step']:06d}")
    assert resumed["step"] < STEPS  # the restart had steps left to train
    _assert_same_losses(deterministic(records), _reference_records(reference))
    assert "could not draw the run's plot" not in err  # the plot reads the event records too
    assert (run_dir / "final" / "config.json").is_file()


# --------------------------------------------------------------------------------------------- 4. the handler


def test_a_repeat_within_the_window_is_the_same_request_and_a_later_one_ends_the_process():
    now = [100.0]
    died: list[int] = []
    request = StopRequest(clock=lambda: now[0], die=died.append)
    assert not request.requested
    request.handle(signal.SIGUSR1)
    assert request.requested and request.signal == "SIGUSR1" and not died
    now[0] += preemption.REPEAT_WINDOW_S / 2
    request.handle(signal.SIGTERM)  # the launcher forwarding what the scheduler sent every process
    assert not died and request.signal == "SIGUSR1"
    now[0] += preemption.REPEAT_WINDOW_S
    request.handle(signal.SIGTERM)
    assert died == [signal.SIGTERM]


def test_stop_signals_are_recorded_in_the_block_and_restored_after():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    with stop_signals() as request:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not request.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert request.signal == "SIGUSR1"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before


SECOND_SIGNAL = """
import os, signal, sys, time
from vlm_sft.trainer import preemption
preemption.REPEAT_WINDOW_S = 0.2
with preemption.stop_signals() as request:
    pid = os.fork()
    if pid == 0:  # a data worker: ignores the first stop signal, the second ends it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as torch's worker handler: SIGTERM ends the worker
        preemption.data_worker_init(0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        os.write(1, b"worker survived the first signal\\n")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == signal.SIGTERM  # the worker ended by the signal
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    assert request.signal == "SIGTERM"
    print("first signal recorded", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
print("never reached")
"""


def test_a_second_signal_ends_the_process_at_once():
    proc = subprocess.run(
        [sys.executable, "-c", SECOND_SIGNAL], env=launch_env(), cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert proc.stdout.splitlines() == ["worker survived the first signal", "first signal recorded"], proc.stderr
    assert "a second time: exiting now" in proc.stderr
