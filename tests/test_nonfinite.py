"""The non-finite guard in process (``vlm_sft/trainer/nonfinite.py``; real runs: ``test_failure_exits.py``).

- A non-finite loss poisons every gradient of its rank, so the reduced gradient norm tells every rank; a finite loss
  leaves the gradients bit for bit as they were.
- ``train_step`` on a step whose loss is inf (planted, with finite gradients) changes no weight, no optimizer state and
  no schedule, and the next step lands where a run that never saw that step lands (plain and FSDP2-sharded).
- The guard counts a run of skips and names its first step; the state check refuses a non-finite weight or moment.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from test_host_syncs import _batch

from vlm_sft.config import TrainConfig
from vlm_sft.model import build_model, tiny_qwen3_5_config
from vlm_sft.parallel import env as distributed
from vlm_sft.parallel.env import DistEnv
from vlm_sft.parallel.failure import agreed
from vlm_sft.trainer.loop import train_step
from vlm_sft.trainer.metrics import ModuleTimer, StepTimer
from vlm_sft.trainer.nonfinite import (
    DivergedError,
    NonFiniteGuard,
    check_finite_state,
    describe_batches,
    poison_nonfinite,
    suspects,
)
from vlm_sft.trainer.optim import build_optimizer, build_scheduler
from vlm_sft.trainer.step_batches import StepBatches

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_a_non_finite_loss_poisons_every_gradient_and_a_finite_one_changes_none():
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    (w * w).sum().backward()
    plain, w.grad = w.grad.clone(), None
    poison_nonfinite((w * w).sum()).backward()
    assert torch.equal(w.grad, plain)  # times exactly 1
    w.grad = None
    poison_nonfinite((w * w).sum() + math.inf).backward()  # x + inf: its own gradient would be finite
    assert torch.isnan(w.grad).all()


def _run(sharded: bool) -> SimpleNamespace:
    """What ``train_step`` reads of a ``Run``: the tiny model (FSDP2 over the current one-rank group when
    ``sharded``), fused AdamW, a constant schedule."""
    from vlm_sft.parallel.parallelize import shard_model

    torch.manual_seed(0)
    model = build_model(tiny_qwen3_5_config(), freeze_vision=False)
    if sharded:
        model = shard_model(model, SimpleNamespace(sharded=True, device=torch.device("cpu"), world_size=1))
    cfg = TrainConfig(lr=1e-2, warmup_steps=0, schedule="constant")
    optimizer = build_optimizer(model, cfg)
    return SimpleNamespace(
        model=model, env=CPU, timer=StepTimer(CPU.device), vision_timer=ModuleTimer(model.model.visual, CPU.device),
        balance=None, cfg=SimpleNamespace(train=cfg), optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg, total_steps=10),
    )  # fmt: skip


def _step(run: SimpleNamespace, batch, *, inf: bool = False):
    """One ``train_step`` on ``batch``; ``inf``: its loss plus inf (a forward hook), gradients still finite."""
    hook = run.model.register_forward_hook(
        lambda module, args, out: dataclasses.replace(out, loss_sum=out.loss_sum + math.inf)
    )
    if not inf:
        hook.remove()
    try:
        step = StepBatches([batch], batch.num_trainable_tokens, batch.num_real_tokens, batch.input_ids.numel(), 0, 0.0)
        return train_step(run, step)
    finally:
        hook.remove()


def _state(run: SimpleNamespace) -> dict[str, torch.Tensor]:
    """Weights, AdamW's moments and step counts, the schedule's position (each tensor's local piece)."""
    local = {n: p.detach() for n, p in run.model.named_parameters()}
    for i, state in enumerate(run.optimizer.state.values()):
        local |= {f"{i}.{k}": v for k, v in state.items()}
    local = {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in local.items()}
    return local | {"scheduler": torch.tensor(run.scheduler.last_epoch)}


def _same(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "fsdp2"])
def test_a_skipped_step_changes_nothing_and_the_run_goes_on_as_without_it(sharded):
    if sharded:
        distributed.dist.init_process_group("cpu:gloo", store=distributed.dist.HashStore(), rank=0, world_size=1)
    try:
        first, bad, third = _batch(), _batch(), _batch()
        skipping, reference = _run(sharded), _run(sharded)
        assert _step(skipping, first).applied and _step(reference, first).applied
        before = _state(skipping)
        stats = _step(skipping, bad, inf=True)
        assert not stats.applied and math.isnan(stats.grad_norm) and stats.micro_losses == [math.inf]
        assert _same(_state(skipping), before) == []  # weights, moments, steps, schedule: untouched
        assert _step(skipping, third).applied and _step(reference, third).applied
        assert _same(_state(skipping), _state(reference)) == []  # as if step 2 had never been
    finally:
        if sharded:
            distributed.dist.destroy_process_group()


def test_the_guard_counts_a_run_of_skips_and_names_its_first_step():
    guard = NonFiniteGuard(3, total=4)
    guard.skipped(7)
    guard.skipped(8)
    guard.applied()
    assert not guard.diverging and guard.total == 6
    for step in (10, 11, 12):
        assert not guard.exhausted
        guard.skipped(step)
    assert guard.exhausted and guard.diverging and guard.total == 9
    error = guard.error(lr=1e6)
    assert error.first_step == 10 and agreed(error)  # every rank raises it: the failure board stays quiet
    assert "steps 10, 11, 12" in str(error) and "first at step 10" in str(error) and "after step 9" in str(error)
    assert "train.lr (now 1e+06; a resume takes the new value)" in str(error)


def test_the_state_check_refuses_a_non_finite_weight_or_moment():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    check_finite_state(model, optimizer, CPU, step=5)
    next(iter(optimizer.state.values()))["exp_avg_sq"][0] = math.inf
    with pytest.raises(DivergedError, match="non-finite value after step 5"):
        check_finite_state(model, optimizer, CPU, step=5)
    next(iter(optimizer.state.values()))["exp_avg_sq"][0] = 0.0
    with torch.no_grad():
        model.bias[1] = math.nan
    with pytest.raises(DivergedError):
        check_finite_state(model, optimizer, CPU, step=5)


def test_the_report_names_the_rows_of_the_bad_micro_batch_and_their_source():
    batch = _batch()
    rows = [i for row in batch.sample_indices for i in row]
    plain = describe_batches([batch, batch], [1.5, math.nan], rank=3, sources=())
    assert [(b["rank"], b["micro_batch"], b["rows"]) for b in suspects(plain)] == [(3, 1, rows)]
    assert suspects(plain)[0]["trainable_tokens"] == batch.num_trainable_tokens
    mixed = describe_batches([batch], [2.0], rank=0, sources=("chat", "ocr"))
    assert mixed[0]["rows"] == [[("chat", "ocr")[i % 2], i // 2] for i in rows]
    assert suspects(mixed) == mixed  # every loss finite: the gradients overflowed, every micro-batch is a suspect


def test_a_resume_with_a_lowered_lr_trains_at_it():
    """The fix a divergence asks for: resume with a lower ``train.lr``. The checkpoint's optimizer groups and schedule
    hold the old peak; the resumed run must take the new one, the schedule's position kept."""
    from vlm_sft.trainer.optim import follow_configured_lr, lr_factor

    def built(lr: float):
        model = torch.nn.Linear(2, 2)
        cfg = TrainConfig(lr=lr, warmup_steps=2, schedule="cosine", optimizer_impl="foreach")
        optimizer = build_optimizer(model, cfg)
        return model, optimizer, build_scheduler(optimizer, cfg, total_steps=10)

    model, optimizer, scheduler = built(1e-2)
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        scheduler.step()
    _, resumed, schedule = built(1e-3)
    resumed.load_state_dict(optimizer.state_dict())  # what a resume restores (checkpoint.state._restore_groups)
    schedule.load_state_dict(scheduler.state_dict())
    factor = lr_factor(3, warmup_steps=2, total_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert resumed.param_groups[0]["lr"] == pytest.approx(1e-2 * factor)  # the checkpoint's peak, silently
    follow_configured_lr(1e-3, resumed, schedule)
    assert [g["lr"] for g in resumed.param_groups] == pytest.approx([1e-3 * factor] * 2)
    resumed.step()
    schedule.step()
    next_factor = lr_factor(4, warmup_steps=2, total_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert [g["lr"] for g in resumed.param_groups] == pytest.approx([1e-3 * next_factor] * 2)
