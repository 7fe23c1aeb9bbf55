"""``train.optimizer_offload``: AdamW's state lives in host memory between steps and on the parameters' device only
inside the step. The steps are the same bit for bit (plain tensors and FSDP2 DTensors, fused and foreach), the state
really is copied out and back around every step, a checkpoint saves and resumes it, and the memory plan takes it out
of the forward / backward peak (the 35B-A3B config fits 80 GB cards with it).

On this CPU-only machine the host is the device, so the copies cost nothing and save nothing: these tests hold the
mechanism (which tensors move, when, with what layout) and the numbers; the memory it frees is on a GPU."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from test_optim import ENV, IMPLS, _cfg, _full_trainable, _net, _sharded_tiny, _steps, _trainable

from vlm_sft.checkpoint.state import TrainerState, capture_rng, load_checkpoint, save_checkpoint
from vlm_sft.trainer.optim import build_optimizer


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("impl", IMPLS)
def test_offloaded_steps_equal_plain_steps_and_the_state_moves_around_each_step(impl, caplog):
    """Five steps with and without the offload: the same weights bit for bit. The tensors a step updates (seen by a
    pre-hook registered after the offload's own) are the device copies; after the step the optimizer holds other
    tensors, the host copies. Without the offload the step updates the very tensors the optimizer holds (the check
    can fail)."""
    plain, offloaded = _net(), _net()
    opt_plain = build_optimizer(plain, _cfg(impl))
    opt_off = build_optimizer(offloaded, _cfg(impl, optimizer_offload=True))
    in_step: dict[str, list[torch.Tensor]] = {}  # the tensors themselves (kept alive: no address is reused)
    for name, opt in (("plain", opt_plain), ("offloaded", opt_off)):
        opt.register_step_pre_hook(lambda o, _a, _k, name=name: in_step.__setitem__(name, _state_tensors(o)))
    _steps(plain, opt_plain, 5)
    with caplog.at_level(logging.INFO, logger="vlm_sft.trainer.optim_offload"):
        _steps(offloaded, opt_off, 5)
    held = re.findall(r"([0-9.]+) (GB|MiB|KiB) of AdamW state held in host memory", caplog.text)
    assert len(held) == 1 and float(held[0][0]) > 0, caplog.text  # said once, in a unit that shows it (not 0.00 GB)
    a, b, start = _weights(plain), _weights(offloaded), _weights(_net())
    assert all(torch.equal(a[n], b[n]) for n in a)  # bit for bit
    assert any(not torch.equal(a[n], start[n]) for n in a)  # and the weights moved
    state = _state_tensors(opt_off)
    assert len(state) == 2 * len(_trainable(opt_off)) > 0  # exp_avg, exp_avg_sq of every trainable tensor
    assert len(in_step["offloaded"]) == len(state)
    assert not {t.data_ptr() for t in state} & {t.data_ptr() for t in in_step["offloaded"]}
    assert all(a is b for a, b in zip(_state_tensors(opt_plain), in_step["plain"], strict=True))
    assert all(t.device.type == "cpu" for t in state)


def test_offload_keeps_fsdp2_dtensor_state_and_resumes_from_a_checkpoint(tmp_path):
    """On FSDP2's DTensors (a 1-rank gloo group): the offloaded state stays DTensors of the parameters' mesh and
    placements, the steps equal the plain run's bit for bit, and a checkpoint of the offloaded run (the distributed
    checkpoint of its host-held state) resumes into a fresh offloaded optimizer to the uninterrupted weights."""
    from test_host_syncs import _batch

    from vlm_sft.parallel import env as distributed

    batch = _batch()
    distributed.dist.init_process_group("cpu:gloo", store=distributed.dist.HashStore(), rank=0, world_size=1)
    try:
        models = {off: _sharded_tiny("full") for off in (False, True)}
        optimizers = {off: build_optimizer(models[off], _cfg("fused", optimizer_offload=off)) for off in (False, True)}

        def step(off: bool) -> None:
            models[off](**batch.model_kwargs()).loss_sum.backward()
            optimizers[off].step()
            optimizers[off].zero_grad()

        for _ in range(2):
            step(False), step(True)
        params = {id(p): p for p in _trainable(optimizers[True])}
        for p_id, state in ((id(p), optimizers[True].state[p]) for p in params.values()):
            for key in ("exp_avg", "exp_avg_sq"):
                assert type(state[key]).__name__ == "DTensor" and state[key].to_local().device.type == "cpu"
                assert state[key].placements == params[p_id].placements and state[key].shape == params[p_id].shape
        saved = TrainerState(step=2, scheduler={}, data={}, rng=capture_rng())
        path = save_checkpoint(
            tmp_path, model=models[True], optimizer=optimizers[True], state=saved, env=ENV, keep_last=1
        )
        for _ in range(2):
            step(False), step(True)
        plain, offloaded = _full_trainable(models[False]), _full_trainable(models[True])
        assert all(torch.equal(plain[n], offloaded[n]) for n in plain)

        models["resumed"] = _sharded_tiny("full")
        optimizers["resumed"] = build_optimizer(models["resumed"], _cfg("fused", optimizer_offload=True))
        load_checkpoint(path, model=models["resumed"], optimizer=optimizers["resumed"], env=ENV)
        assert all(t.to_local().device.type == "cpu" for t in _state_tensors(optimizers["resumed"]))
        for _ in range(2):
            step("resumed")
        resumed = _full_trainable(models["resumed"])
    finally:
        distributed.dist.destroy_process_group()
    assert all(torch.equal(resumed[n], offloaded[n]) for n in offloaded)


def test_the_plan_takes_the_state_out_of_the_forward_backward_peak():
    """The 35B-A3B config (ep 8, fused, offload) plans <= 72 GB per rank at 8 GPUs; without the offload 90 GB.
    With it, training is the larger of the forward / backward peak and the step's."""
    from vlm_sft.checks.memory_plan import GB, plan_for_run
    from vlm_sft.config import REPO_ROOT, load_config

    path = REPO_ROOT / "configs" / "qwen3_5_35b_a3b.toml"
    assert load_config(path, []).train.optimizer_offload
    offloaded = plan_for_run(load_config(path, []), 8)
    held = plan_for_run(load_config(path, ["--train.optimizer_offload", "false"]), 8)
    assert offloaded.host_optimizer_state == offloaded.optimizer_state == held.optimizer_state > 30 * GB
    assert held.host_optimizer_state == 0 and held.training > 85 * GB
    assert offloaded.training <= 72 * GB
    p = offloaded
    step_peak = p.params + p.grads + p.optimizer_state + p.optimizer_temporaries
    forward_backward = p.params + p.grads + p.gathered_weights + p.activations + p.expert_dispatch
    assert p.training == max(step_peak, forward_backward)
    assert held.training == forward_backward + p.optimizer_state + p.optimizer_temporaries
