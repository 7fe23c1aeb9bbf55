"""Every way a run stops, in real runs started together (independent: they share the two cores), each watched for its
exit code, the seconds from its message to its exit, and the processes it leaves behind.

- A data error raised in a data worker (every image broken, over ``data.max_skip_fraction``), with 1 process and 1
  worker, and with 2 processes of 2 workers: before, the process printed the skip report and never exited (its exit
  handler joined a worker that ignores the first SIGTERM).
- A config error raised after the data workers started, and Ctrl-C (SIGINT to the training process alone).
- A diverging run (``--train.lr 1e6``): it stops after ``train.max_nonfinite_steps`` skipped steps with exit code 3,
  naming the first, and nothing it wrote after the divergence began holds a non-finite tensor (before: it trained to
  the end, saved NaN checkpoints and ``final/``, and exited 0).
- One planted inf in one micro-batch's loss on rank 1 of 2 (finite gradients: only the agreement tells rank 0): both
  ranks skip the update, so ``final/`` after that step equals the checkpoint before it, bit for bit, and the run
  finishes.
- Every process of a multi-process run leaves through the CLI's one exit path, without the interpreter's teardown
  (``fault_run.TEARDOWN_MARKER`` never printed by them).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from fault_run import TEARDOWN_MARKER
from safetensors.torch import load_file
from train_helpers import Background, descendants, is_alive, process_table, read_metrics, tiny_run_args

from vlm_sft.checkpoint.resume import complete_checkpoints, resolve_resume, verify_checkpoint
from vlm_sft.config import REPO_ROOT
from vlm_sft.data.shapes import materialize_shapes

FAULT_RUN = str(REPO_ROOT / "tests" / "fault_run.py")
EXIT_WITHIN_S = 30.0
"""An error exit ends within this many seconds of its message (the data workers get 5 s, then are killed)."""


SLOTS = 3
"""Training processes running at once (a 2-process run takes 2): more only make each slower on 2 cores (measured: 6
runs at once took longer than 3 slots)."""


@dataclass
class Watched:
    """A background run (started when a slot is free), its message, and what the watch saw."""

    start: Callable[[], Background]
    procs: int
    tmp: Path
    message: str
    """A line of the run's stderr that starts its exit (the error, or ``step 2/`` for the SIGINT run)."""
    interrupt: bool = False
    """Send SIGINT to the training process once ``message`` appears."""
    run: Background | None = None
    pids: set[int] = field(default_factory=set)
    """Every process seen below the run."""
    sessions: set[int] = field(default_factory=set)
    """Their sessions (torchrun starts each rank in its own): a data worker orphaned before the watch saw it is
    found through its session."""
    message_at: float | None = None
    exit_at: float | None = None
    code: int | None = None
    out: str = ""
    err: str = ""


def _broken_images(tmp: Path, rows: int = 64) -> Path:
    """Shapes rows with an image, each image a file that is not a picture: every sample is skipped."""
    shapes = materialize_shapes(tmp / "shapes", num_train=rows, num_eval=0, seed=1, image_size=32, progress=False)
    folder = shapes["train"].parent
    (folder / "broken.png").write_bytes(b"not a png at all")
    lines = [line for line in shapes["train"].read_text().splitlines() if '"image": "' in line]
    broken = (re.sub(r'"image": "[^"]+"', '"image": "broken.png"', line) for line in lines)
    (folder / "broken.jsonl").write_text("".join(f"{line}\n" for line in broken))
    return folder / "broken.jsonl"


def _plan(tmp_path_factory) -> dict[str, Watched]:
    """The runs, the 2-process ones first (the longest)."""
    runs: dict[str, Watched] = {}

    def plan(name: str, message: str, nproc: int = 1, fault: str = "", interrupt: bool = False, **args):
        tmp = tmp_path_factory.mktemp(name)
        args, env = tiny_run_args(tmp, **args), {"VLM_SFT_FAULT": fault}
        runs[name] = Watched(
            lambda: Background(args, nproc=nproc, script=FAULT_RUN, env=env), nproc, tmp, message, interrupt
        )

    broken = str(_broken_images(tmp_path_factory.mktemp("data")))
    skips = {"data.source": broken, "train.max_steps": 50}
    plan("inf_rank1", "step 2 not applied", nproc=2, fault="inf_loss:2:1", **{"train.save_every": 1})
    plan("skips_2x2", "data error:", nproc=2, **skips, **{"data.num_workers": 2})
    plan("diverge", "diverged:", **{"train.lr": 1e6, "train.max_steps": 12, "train.save_every": 1,
                                    "train.keep_last": 20, "data.num_workers": 1})  # fmt: skip
    # Long enough to outlast any delay of the watch: the interrupt ends it at step 2 or so, the watch's timeout if not.
    plan("sigint", "step 2/", interrupt=True, **{"train.max_steps": 100000, "data.num_workers": 1})
    plan("config", "config error:", fault="config_error", **{"data.num_workers": 2})
    plan("skips_1x1", "data error:", **skips, **{"data.num_workers": 1})
    return runs


def _watch(runs: dict[str, Watched], timeout: float = 240.0) -> None:
    """Start runs as slots free up, and poll each until all ended: the processes below it, when its message appeared,
    when it exited."""
    deadline = time.monotonic() + timeout
    while any(w.code is None for w in runs.values()) and time.monotonic() < deadline:
        busy = sum(w.procs for w in runs.values() if w.run is not None and w.code is None)
        for w in runs.values():
            if w.run is None and busy + w.procs <= SLOTS:
                w.run, busy = w.start(), busy + w.procs
        table = process_table()
        for w in runs.values():
            if w.run is None or w.code is not None:
                continue
            w.pids.update(descendants(w.run.proc.pid, table))
            w.sessions.update(table[pid][1] for pid in [w.run.proc.pid, *w.pids] if pid in table)
            if w.message_at is None and w.message in w.run._output()[1]:
                w.message_at = time.monotonic()
                if w.interrupt:
                    os.kill(w.run.proc.pid, signal.SIGINT)
            if w.run.proc.poll() is not None:
                w.exit_at, w.code = time.monotonic(), w.run.proc.returncode
                w.out, w.err = w.run._output()
        time.sleep(0.2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Watched]:
    planned = _plan(tmp_path_factory)
    try:
        _watch(planned)
    finally:
        for w in planned.values():
            if w.run is not None:
                w.run.kill()  # the ones that hung
    return planned


def _check_exit(w: Watched, code: int) -> None:
    assert w.code == code, (w.code, w.err[-4000:])
    assert w.message_at is not None, w.err[-4000:]
    assert w.exit_at - w.message_at < EXIT_WITHIN_S, (w.exit_at - w.message_at, w.err[-3000:])
    table = process_table()
    left = [pid for pid in w.pids | {p for p, (_, session) in table.items() if session in w.sessions} if is_alive(pid)]
    assert not left, f"processes left behind: {left}"


@pytest.mark.parametrize("name", ["skips_1x1", "skips_2x2"])
def test_a_data_error_in_a_worker_exits_and_ends_every_worker(runs, name):
    w = runs[name]
    _check_exit(w, 1)
    assert "data.max_skip_fraction" in w.err and "corrupt_image" in w.err
    assert "SkipFractionError in DataLoader worker process" in w.err  # raised in a data worker


def test_a_config_error_after_the_workers_started_exits_with_2(runs):
    w = runs["config"]
    _check_exit(w, 2)
    assert "planted: a setting refused after the data workers started" in w.err


def test_ctrl_c_exits_with_130_and_ends_the_workers(runs):
    w = runs["sigint"]
    _check_exit(w, 130)
    assert "interrupted (Ctrl-C)" in w.err
    assert not (w.tmp / "run" / "final").exists()


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint: its HF export's weights and its DCP state (model and optimizer)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    tensors = {f"hf.{k}": v for f in (checkpoint / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    dcp = _load_state_dict_from_keys(checkpoint_id=str(checkpoint))
    stack = [("dcp", dcp)]
    while stack:
        prefix, node = stack.pop()
        for k, v in node.items():
            if isinstance(v, dict):
                stack.append((f"{prefix}.{k}", v))
            elif isinstance(v, torch.Tensor):
                tensors[f"{prefix}.{k}"] = v
    return tensors


def test_a_diverging_run_stops_naming_the_first_bad_step_and_writes_nothing_after_it(runs):
    w = runs["diverge"]
    _check_exit(w, 3)
    run = w.tmp / "run"
    records = read_metrics(run)
    skipped = [r["step"] for r in records if r.get("event") == "nonfinite_step"]
    first = skipped[0]
    assert skipped == [first, first + 1, first + 2], skipped  # train.max_nonfinite_steps = 3 in a row, then stop
    assert f"first at step {first};" in w.err
    assert [r["nonfinite_steps"] for r in records if "loss" in r][-1] == 3
    assert records[-1] == {"step": first + 2, "event": "diverged", "first_nonfinite_step": first, "nonfinite_steps": 3}
    assert not (run / "final").exists()
    saved = complete_checkpoints(run)
    assert saved and max(int(p.name.split("-")[1]) for p in saved) == first - 1  # nothing saved from `first` on
    assert all(verify_checkpoint(p).ok for p in saved)
    assert resolve_resume("latest", run) == saved[-1]
    for checkpoint in saved:
        bad = [k for k, t in _tensors(checkpoint).items() if t.is_floating_point() and not torch.isfinite(t).all()]
        assert not bad, (checkpoint, bad[:5])


def test_one_rank_non_finite_loss_is_skipped_by_both_ranks(runs):
    w = runs["inf_rank1"]
    assert w.code == 0, w.err[-6000:]
    run = w.tmp / "run"
    event = next(r for r in read_metrics(run) if r.get("event") == "nonfinite_step")
    assert event["step"] == 2 and event["consecutive"] == 1 and event["nonfinite_steps"] == 1
    assert [(b["rank"], b["loss_sum"]) for b in event["batches"]] == [(1, float("inf"))]  # rank 1's alone
    assert "step 2 not applied: gradient norm nan, non-finite loss in rank 1 micro-batch 0" in w.err
    before = load_file(run / "checkpoints" / "step-000001" / "hf" / "model.safetensors")
    after = load_file(run / "final" / "model.safetensors")
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, changed[:5]  # step 2 changed no weight on either rank


@pytest.mark.parametrize("name", ["skips_2x2", "inf_rank1"])
def test_every_process_of_a_multi_process_run_skips_the_teardown(runs, name):
    """The CLI's one exit path (``end_process``) for an error (a data error) as for a finished run; torchrun reports
    no rank ended by a signal (the SIGABRT of gloo's teardown was reported as ``exitcode: -6``)."""
    w = runs[name]
    assert TEARDOWN_MARKER not in w.err, w.err[-3000:]
    assert not re.search(r"exitcode\s*:\s*-\d", w.err), w.err[-3000:]


def test_the_single_process_runs_exit_normally(runs):
    """One process leaves through ``sys.exit`` (its teardown runs, with no worker left to wait for)."""
    assert all(TEARDOWN_MARKER in runs[n].err for n in ("skips_1x1", "config", "sigint", "diverge"))


def test_the_metrics_of_a_finished_run_count_no_skip_when_there_was_none(runs):
    records = [r for r in read_metrics(runs["inf_rank1"].tmp / "run") if "loss" in r]
    assert [r["nonfinite_steps"] for r in records] == [0, 1]
    assert json.loads((runs["inf_rank1"].tmp / "run" / "data_accounting.json").read_text())["samples_seen"] > 0
