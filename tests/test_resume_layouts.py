"""Resume on another number of processes: a checkpoint of 2 processes x 1 micro-batch resumed by 1 process x 2
micro-batches (the same global batch) continues exactly as the uninterrupted run (DCP reshards model and optimizer,
the data position is global), and a resume that would change the global batch is refused with the fix."""

from __future__ import annotations

import pytest
from train_helpers import Background, deterministic, read_metrics, run_training, tiny_run_args

COMMON = {"train.max_steps": 4, "train.save_every": 2, "train.warmup_steps": 1}


def test_two_processes_resume_on_one_with_the_same_global_batch(tmp_path):
    whole = tmp_path / "whole"
    run_training(tiny_run_args(whole, **COMMON), nproc=2)
    checkpoint = whole / "run" / "checkpoints" / "step-000002"
    assert sorted(p.name for p in checkpoint.glob("data-rank*.json")) == ["data-rank00000.json", "data-rank00001.json"]

    refused = Background(tiny_run_args(tmp_path / "refused", **COMMON, **{"train.resume": str(checkpoint)}))
    resumed = tmp_path / "resumed"
    run_training(
        tiny_run_args(resumed, **COMMON, **{"train.micro_batches": 2, "train.resume": str(checkpoint)}), nproc=1
    )
    expected = [r for r in deterministic(read_metrics(whole / "run")) if r["step"] > 2]
    got = deterministic(read_metrics(resumed / "run"))
    assert [r["step"] for r in got] == [3, 4] == [r["step"] for r in expected]
    for a, b in zip(got, expected, strict=True):
        assert (a["trainable_tokens"], a["real_tokens"], a["images"]) == (
            b["trainable_tokens"],
            b["real_tokens"],
            b["images"],
        )
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)

    proc = refused.wait(check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "written with 2 processes x 1 micro-batch = global batch 2" in proc.stderr
    assert "set train.micro_batches = 2" in proc.stderr
