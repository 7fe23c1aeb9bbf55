"""Trainer building blocks on a toy model: decay groups, the schedule, atomic checkpoints and exact restore."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from vlm_sft.config import TrainConfig
from vlm_sft.trainer.checkpoint import (
    TrainerState,
    capture_rng,
    complete_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from vlm_sft.trainer.distributed import DistEnv
from vlm_sft.trainer.optim import build_optimizer, build_scheduler, lr_factor, param_groups


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.A_log = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return self.norm(self.proj(self.embed_tokens(x))).sum() + self.A_log.sum()


ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_no_decay_on_norms_biases_embeddings():
    model = Toy()
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in decay["params"]} == {"proj.weight"}
    assert {names[id(p)] for p in no_decay["params"]} == {
        "embed_tokens.weight",
        "proj.bias",
        "norm.weight",
        "norm.bias",
        "A_log",
    }
    assert no_decay["weight_decay"] == 0.0


def test_schedule_warmup_then_cosine_to_floor():
    kw = {"warmup_steps": 10, "total_steps": 110, "schedule": "cosine", "min_lr_ratio": 0.1}
    assert lr_factor(0, **kw) == pytest.approx(0.1)
    assert lr_factor(9, **kw) == pytest.approx(1.0)
    assert lr_factor(60, **kw) == pytest.approx(0.55)
    assert lr_factor(110, **kw) == pytest.approx(0.1)
    assert lr_factor(50, **{**kw, "schedule": "constant"}) == 1.0
    assert all(lr_factor(s, **kw) > 0 for s in range(200)) and not math.isnan(lr_factor(500, **kw))


def _train(model, opt, sched, steps, start=0):
    losses = []
    for s in range(start, start + steps):
        loss = model(torch.tensor([s % 10, (s * 3) % 10]))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_checkpoint_restores_exactly_and_keeps_last(tmp_path):
    cfg = TrainConfig(lr=1e-2, warmup_steps=2, max_steps=10)
    torch.manual_seed(0)
    ref = Toy()
    model = Toy()
    model.load_state_dict(ref.state_dict())
    opt_ref, opt = build_optimizer(ref, cfg), build_optimizer(model, cfg)
    sch_ref, sch = build_scheduler(opt_ref, cfg, 10), build_scheduler(opt, cfg, 10)
    expected = _train(ref, opt_ref, sch_ref, 8)

    _train(model, opt, sch, 2)
    for step in (2, 3, 4):
        if step > 2:
            _train(model, opt, sch, 1, start=step - 1)
        state = TrainerState(step=step, scheduler=sch.state_dict(), data={"pos": step}, rng=capture_rng(), extra={})
        save_checkpoint(tmp_path, model=model, optimizer=opt, state=state, env=ENV, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000003", "step-000004"]

    fresh = Toy()
    opt2 = build_optimizer(fresh, cfg)
    sch2 = build_scheduler(opt2, cfg, 10)
    restored = load_checkpoint(resolve_resume("latest", tmp_path), model=fresh, optimizer=opt2, env=ENV)
    sch2.load_state_dict(restored.scheduler)
    assert restored.step == 4 and restored.data == {"pos": 4}
    assert _train(fresh, opt2, sch2, 4, start=4) == expected[4:]


def test_interrupted_save_is_never_loaded(tmp_path):
    model = Toy()
    opt = build_optimizer(model, TrainConfig())
    state = TrainerState(step=1, scheduler={}, data={}, rng=capture_rng(), extra={})
    save_checkpoint(tmp_path, model=model, optimizer=opt, state=state, env=ENV, keep_last=2)
    half = tmp_path / "checkpoints" / "step-000002.tmp"
    half.mkdir()
    (half / "rank00000.pt").write_bytes(b"partial")
    assert resolve_resume("latest", tmp_path).name == "step-000001"
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_resume(str(half), tmp_path)
