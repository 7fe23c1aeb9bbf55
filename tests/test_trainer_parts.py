"""Trainer building blocks on a toy model: decay groups, the schedule, atomic checkpoints, exact restore into an
uninitialized model, and a checkpoint that never runs code when read (no pickle anywhere)."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch
from torch import nn

from vlm_sft.checkpoint.state import (
    TRAINER_STATE,
    TrainerState,
    capture_rng,
    complete_checkpoints,
    data_file,
    load_checkpoint,
    read_trainer_state,
    resolve_resume,
    restore_rng,
    rng_file,
    save_checkpoint,
)
from vlm_sft.config import TrainConfig
from vlm_sft.parallel.dcp import SafeReader
from vlm_sft.parallel.env import DistEnv
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


def test_schedule_warmup_stable_decay():
    kw = {"warmup_steps": 10, "total_steps": 110, "schedule": "wsd", "min_lr_ratio": 0.1, "decay_fraction": 0.2}
    assert lr_factor(0, **kw) == pytest.approx(0.1) and lr_factor(9, **kw) == pytest.approx(1.0)
    assert all(lr_factor(s, **kw) == 1.0 for s in range(10, 88))  # the peak until the last 22 steps
    assert lr_factor(99, **kw) == pytest.approx(0.55)  # halfway through the decay: a cosine to the floor
    assert lr_factor(110, **kw) == pytest.approx(0.1)
    whole = {**kw, "decay_fraction": 1.0}  # a decay over the whole run starts after the warmup: the cosine
    assert all(lr_factor(s, **whole) == pytest.approx(lr_factor(s, **{**kw, "schedule": "cosine"})) for s in range(120))


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
        state = TrainerState(step=step, scheduler=sch.state_dict(), data={"pos": step}, rng=capture_rng())
        save_checkpoint(tmp_path, model=model, optimizer=opt, state=state, env=ENV, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000003", "step-000004"]

    fresh = Toy()
    with torch.no_grad():  # what a resume built on meta and materialized with to_empty holds: anything
        for p in fresh.parameters():
            p.fill_(float("nan"))
    opt2 = build_optimizer(fresh, cfg)
    sch2 = build_scheduler(opt2, cfg, 10)
    restored = load_checkpoint(resolve_resume("latest", tmp_path), model=fresh, optimizer=opt2, env=ENV)
    sch2.load_state_dict(restored.scheduler)
    assert restored.step == 4 and restored.data == {"pos": 4}
    assert _train(fresh, opt2, sch2, 4, start=4) == expected[4:]


def test_interrupted_save_is_never_loaded(tmp_path):
    model = Toy()
    opt = build_optimizer(model, TrainConfig())
    state = TrainerState(step=1, scheduler={}, data={}, rng=capture_rng())
    save_checkpoint(tmp_path, model=model, optimizer=opt, state=state, env=ENV, keep_last=2)
    half = tmp_path / "checkpoints" / "step-000002.tmp"
    half.mkdir()
    (half / TRAINER_STATE).write_bytes(b"partial")
    assert resolve_resume("latest", tmp_path).name == "step-000001"
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_resume(str(half), tmp_path)


class _Payload:
    """Unpickling this creates ``marker``: what a checkpoint from elsewhere could do to a reader that unpickles."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _saved(tmp_path):
    model = Toy()
    opt = build_optimizer(model, TrainConfig())
    model(torch.tensor([1, 2])).backward()
    opt.step()
    rng = capture_rng()
    counters = {"base_fingerprint": "f00d", "trackers": {"tensorboard": {"logging_dir": "tb"}}, "nonfinite_steps": 2}
    state = TrainerState(step=1, scheduler={}, data={"streams": {"0": {"epoch": 0}}}, rng=rng, **counters)
    return save_checkpoint(tmp_path, model=model, optimizer=opt, state=state, env=ENV, keep_last=2), model, opt


def test_checkpoint_holds_no_pickled_entry_and_restores_the_rng(tmp_path):
    path, _, opt = _saved(tmp_path)
    before = torch.rand(3)
    metadata = SafeReader(str(path)).read_metadata()
    kinds = {type(v).__name__ for v in metadata.state_dict_metadata.values()}
    assert kinds == {"TensorStorageMetadata"}  # DCP writes any other value as a pickle (BytesStorageMetadata)
    groups = json.loads((path / TRAINER_STATE).read_text())["param_groups"]
    assert [g["weight_decay"] for g in groups] == [g["weight_decay"] for g in opt.param_groups]
    fresh = Toy()
    opt2 = build_optimizer(fresh, TrainConfig())
    state = load_checkpoint(path, model=fresh, optimizer=opt2, env=ENV)
    assert (state.base_fingerprint, state.trackers, state.nonfinite_steps) == (
        "f00d",
        {"tensorboard": {"logging_dir": "tb"}},
        2,
    )
    assert state.world_size == 1
    assert opt2.param_groups[0]["betas"] == opt.param_groups[0]["betas"]  # a tuple again after JSON
    restore_rng(state.rng)
    assert torch.equal(torch.rand(3), before)


def test_the_counters_keep_the_trainer_state_format_of_every_checkpoint(tmp_path):
    """``trainer_state.json`` keeps the typed counters under ``extra`` with the keys earlier checkpoints have (so
    either version reads the other's), and a state file of an older vlm-sft, without some of them, reads with their
    defaults. Fails when the typed fields are written under other keys, or a missing counter is an error."""
    path, _, _ = _saved(tmp_path)
    main = json.loads((path / TRAINER_STATE).read_text())
    assert main["extra"] == {"base": "f00d", "trackers": {"tensorboard": {"logging_dir": "tb"}}, "nonfinite_steps": 2}
    for extra, expected in [({"base": None, "trackers": {}}, (None, {}, 0)), ({}, (None, None, 0))]:
        (path / TRAINER_STATE).write_text(json.dumps(main | {"extra": extra}))  # before the non-finite counter
        state = read_trainer_state(path, env=ENV)
        assert (state.base_fingerprint, state.trackers, state.nonfinite_steps) == expected
        assert state.step == 1 and state.data == {"streams": {"0": {"epoch": 0}}}


@pytest.mark.parametrize("victim", [TRAINER_STATE, data_file(0), rng_file(0), ".metadata"])
def test_a_pickle_in_the_checkpoint_is_never_executed(tmp_path, victim):
    path, _, _ = _saved(tmp_path)
    marker = tmp_path / "pwned"
    (path / victim).write_bytes(pickle.dumps(_Payload(str(marker))))
    fresh = Toy()
    opt = build_optimizer(fresh, TrainConfig())
    with pytest.raises((ValueError, pickle.UnpicklingError), match=r"not JSON|RNG state|refused"):
        load_checkpoint(path, model=fresh, optimizer=opt, env=ENV)
    assert not marker.exists()


def test_an_old_pickled_checkpoint_is_refused_with_the_reason(tmp_path):
    old = tmp_path / "step-000003"
    old.mkdir()
    (old / "rank00000.pt").write_bytes(b"a pickle")
    with pytest.raises(ValueError, match=r"is a pickle .* never read"):
        load_checkpoint(old, model=Toy(), optimizer=build_optimizer(Toy(), TrainConfig()), env=ENV)
