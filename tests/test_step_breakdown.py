"""Where a step's time goes: the per-step sections and FLOP fields of ``metrics.jsonl`` (no timing assertions)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from train_helpers import tiny_run_args

from vlm_sft.config import load_config
from vlm_sft.trainer.loop import train
from vlm_sft.trainer.metrics import STEP_SECTIONS, ModuleTimer, StepTimer, step_breakdown

BREAKDOWN_KEYS = ("data_s", "vision_s", "text_forward_s", "forward_s", "backward_s", "optimizer_s", "step_time_s")


@pytest.fixture(scope="module")
def metrics(tmp_path_factory) -> list[dict]:
    """Three steps of the tiny default run, in this process, with an eval after every step."""
    tmp = tmp_path_factory.mktemp("breakdown")
    args = tiny_run_args(
        tmp, **{"train.max_steps": 3, "data.shapes.num_eval": 8, "train.eval_every": 1, "train.micro_batches": 2}
    )
    cfg = load_config("configs/debug.toml", args)
    train(cfg)
    lines = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r]


def test_every_step_logs_the_breakdown_and_flops(metrics):
    assert [r["step"] for r in metrics] == [1, 2, 3]
    for r in metrics:
        for key in (*BREAKDOWN_KEYS, "flops_per_step", "tflops", "mfu", "tokens_per_s"):
            assert key in r, f"{key} missing from {sorted(r)}"
        assert r["mfu"] is None  # no peak rate is known for a CPU


def test_sections_sum_to_the_step_time(metrics):
    for r in metrics:
        assert all(r[k] >= 0 for k in BREAKDOWN_KEYS)
        assert math.isclose(sum(r[k] for k in STEP_SECTIONS), r["step_time_s"], rel_tol=1e-9)
        assert math.isclose(r["vision_s"] + r["text_forward_s"], r["forward_s"], rel_tol=1e-9, abs_tol=1e-12)
        # The vision tower ran inside the forward (also after an eval, whose forwards must not be charged here).
        assert 0 < r["vision_s"] <= r["forward_s"]


def test_flop_fields_agree(metrics):
    for r in metrics:
        assert r["flops_per_step"] > 0
        # log_every = 1: the window is the step itself
        assert math.isclose(r["tflops"] * 1e12, r["flops_per_step"] / r["step_time_s"], rel_tol=1e-6)


def test_step_breakdown_splits_forward_into_vision_and_text():
    out = step_breakdown({"data_s": 1.0, "forward_s": 3.0, "vision_s": 0.5, "backward_s": 4.0, "optimizer_s": 0.25})
    assert out["text_forward_s"] == 2.5 and out["vision_s"] == 0.5
    assert out["step_time_s"] == 8.25  # vision_s is inside forward_s, never counted twice


def test_step_timer_add_is_not_a_section():
    timer = StepTimer(torch.device("cpu"))
    timer.mark("data_s")
    timer.add("vision_s", 123.0)
    timer.mark("forward_s")
    sections = timer.reset()
    assert sections["vision_s"] == 123.0 and sections["forward_s"] < 123.0


class _Clock:
    """A fake ``perf_counter``: modules advance it, so timings are exact and no test depends on the machine."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Tick(nn.Module):
    def __init__(self, clock: _Clock, seconds: float, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.clock, self.seconds, self.inner = clock, seconds, inner

    def forward(self, x):
        self.clock.now += self.seconds
        return self.inner(x) if self.inner is not None else x


def test_module_timer_charges_only_its_module_and_resets(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("vlm_sft.trainer.metrics.time.perf_counter", clock)
    outer = _Tick(clock, 5.0, _Tick(clock, 1.0))
    timer = ModuleTimer(outer.inner, torch.device("cpu"))
    outer(torch.zeros(1))
    outer(torch.zeros(1))
    assert timer.take() == 2.0  # two calls of the inner module, not the outer module's 10 s
    assert timer.take() == 0.0  # take() resets
    timer.remove()
    outer(torch.zeros(1))
    assert timer.take() == 0.0  # hooks removed
