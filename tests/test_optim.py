"""``train.optimizer_impl``: fused and foreach AdamW take the same steps (plain tensors, FSDP2 DTensors, a bf16 LoRA
model), the config picks the kernel that really runs, a resume keeps the configured one, and the memory plan counts
the step temporaries that implementation allocates."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from vlm_sft.checkpoint.state import TrainerState, capture_rng, load_checkpoint, save_checkpoint
from vlm_sft.config import ConfigError, TrainConfig, load_config
from vlm_sft.parallel.env import DistEnv
from vlm_sft.trainer.optim import build_optimizer

IMPLS = ("fused", "foreach")
ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
TOL = {"rtol": 1e-5, "atol": 1e-6}
"""fused vs foreach after a few steps of lr 1e-2: float rounding (seen: 3e-8), against ~1e-3 for a wrong lr or decay."""


class Net(nn.Module):
    """Both decay groups: two matrices that decay, and an embedding, biases and a norm that do not."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.tanh(self.proj(self.embed_tokens(ids))))).square().mean()


def _cfg(impl: str, **extra) -> TrainConfig:
    return TrainConfig(optimizer_impl=impl, **({"lr": 1e-2, "weight_decay": 0.1} | extra))


def _train(model: nn.Module, cfg: TrainConfig, steps: int = 5, start: int = 0) -> dict[str, torch.Tensor]:
    """``steps`` AdamW steps on seeded batches; the weights after them."""
    optimizer = build_optimizer(model, cfg)
    _steps(model, optimizer, steps, start)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(step))
        model(ids).backward()
        optimizer.step()
        optimizer.zero_grad()


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _assert_all_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _differs(a: dict, b: dict) -> bool:
    return any(not torch.allclose(a[n], b[n], **TOL) for n in a)


def test_the_config_selects_the_implementation():
    assert TrainConfig().optimizer_impl == "fused"  # torchtitan's default, and ours
    model = _net()
    flags = {impl: build_optimizer(model, _cfg(impl)).defaults for impl in IMPLS}
    assert (flags["fused"]["fused"], flags["fused"]["foreach"]) == (True, None)
    assert (flags["foreach"]["fused"], flags["foreach"]["foreach"]) == (None, True)
    assert load_config(None, ["--train.optimizer_impl", "foreach"]).train.optimizer_impl == "foreach"
    with pytest.raises(ConfigError, match="optimizer_impl"):
        load_config(None, ["--train.optimizer_impl", "fast"])


class _Ops(TorchDispatchMode):
    """The aten ops a step dispatches, and the bytes each call returned in fresh tensors (not its inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.data_ptr() for t in _tensors((args, kwargs))}
        fresh = sum(t.nbytes for t in _tensors(out) if t.data_ptr() not in inputs)
        self.calls.append((str(func.overloadpacket.__name__), fresh))
        return out


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    return []


def _step_ops(impl: str) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """The ops of a second AdamW step (the first creates the state) and each group's trainable bytes."""
    model = _net()
    optimizer = build_optimizer(model, _cfg(impl))
    _steps(model, optimizer, 1)
    model(torch.arange(6).view(1, 6)).backward()
    with _Ops() as ops:
        optimizer.step()
    groups = {f"group{i}": sum(p.nbytes for p in g["params"]) for i, g in enumerate(optimizer.param_groups)}
    return ops.calls, groups


def test_the_chosen_kernel_runs_and_allocates_what_the_plan_counts():
    """fused: one ``_fused_adamw_`` call per group, nothing allocated beyond the state; foreach: ``_foreach_sqrt``
    copies each group's shard (``memory_plan.STEP_TEMPORARY_COPIES``; the bench measures the peaks)."""
    from vlm_sft.checks.memory_plan import STEP_TEMPORARY_COPIES

    fused, groups = _step_ops("fused")
    foreach, _ = _step_ops("foreach")
    assert [name for name, _ in fused if "fused" in name] == ["_fused_adamw_"] * len(groups)
    assert not any(name.startswith("_foreach_sqrt") for name, _ in fused)
    assert STEP_TEMPORARY_COPIES["fused"] == 0 and max(fresh for _, fresh in fused) < 1024  # scalars at most
    copies = sorted(fresh for name, fresh in foreach if name == "_foreach_sqrt")
    assert copies == sorted(groups.values())  # one copy of each group, groups one after the other
    assert max(copies) <= STEP_TEMPORARY_COPIES["foreach"] * sum(groups.values())
    assert not any("fused" in name for name, _ in foreach)


def test_fused_and_foreach_take_the_same_steps():
    """Five steps with weight decay on both groups agree to float rounding; a run with another lr or no decay does
    not (so the tolerance can tell a wrong update from rounding)."""
    runs = {impl: _train(_net(), _cfg(impl)) for impl in IMPLS}
    _assert_all_close(runs["fused"], runs["foreach"])
    start = {n: p.detach() for n, p in _net().named_parameters()}
    assert _differs(runs["fused"], start)  # the weights moved
    assert _differs(runs["fused"], _train(_net(), _cfg("foreach", lr=1.1e-2)))
    assert _differs(runs["fused"], _train(_net(), _cfg("foreach", weight_decay=0.0)))


def _sharded_tiny(kind: str) -> nn.Module:
    """The tiny Qwen3.5 in fp32 (full fine-tuning), or the bf16 LoRA model whose frozen base is stored in bf16 beside
    fp32 adapters and lm_head (``test_lora``), sharded by FSDP2 over the one rank of the current group."""
    from test_lora import _bf16_lora_model

    from vlm_sft.model import build_model
    from vlm_sft.model.presets import tiny_qwen3_5_config
    from vlm_sft.parallel.parallelize import shard_model

    torch.manual_seed(0)
    model = build_model(tiny_qwen3_5_config(), freeze_vision=True) if kind == "full" else _bf16_lora_model("bfloat16")
    env = SimpleNamespace(sharded=True, device=torch.device("cpu"), world_size=1)
    return shard_model(model, env, param_dtype=torch.bfloat16 if kind == "lora-bf16" else None)


@pytest.mark.parametrize("kind", ["full", "lora-bf16"])
def test_fused_steps_fsdp2_dtensors_like_foreach(kind):
    """On FSDP2's DTensors (a 1-rank gloo group) fused AdamW runs and, given the same gradients, takes foreach's
    steps; with a bf16 LoRA base only the fp32 trainables reach it. (Each step's gradients come from the fused model
    and are copied to the foreach one: on gradients recomputed from weights that differ by rounding, AdamW's
    ``g / (sqrt(v) + eps)`` turns 1e-9 into up to lr where a gradient is near eps, which says nothing about the
    optimizer.)"""
    from test_host_syncs import _batch

    from vlm_sft.parallel import env as distributed

    batch = _batch()
    distributed.dist.init_process_group("cpu:gloo", store=distributed.dist.HashStore(), rank=0, world_size=1)
    try:
        models = {impl: _sharded_tiny(kind) for impl in IMPLS}
        optimizers = {impl: build_optimizer(models[impl], _cfg(impl)) for impl in IMPLS}
        fused, foreach = (_trainable(optimizers[impl]) for impl in IMPLS)
        assert fused and all(type(p).__name__ == "DTensor" for p in fused)
        assert {p.dtype for p in fused} == {torch.float32}
        start = _full_trainable(models["fused"])
        for _ in range(3):
            models["fused"](**batch.model_kwargs()).loss_sum.backward()
            for a, b in zip(fused, foreach, strict=True):
                b.grad = a.grad.clone()
            for optimizer in optimizers.values():
                optimizer.step()
                optimizer.zero_grad()
        runs = {impl: _full_trainable(model) for impl, model in models.items()}
    finally:
        distributed.dist.destroy_process_group()
    _assert_all_close(runs["fused"], runs["foreach"])
    assert _differs(runs["fused"], start)  # the weights moved


def _full_trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _trainable(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def test_fused_is_refused_with_the_fix_where_torch_has_no_kernel():
    """Trainable tensors on a device without a fused kernel (here: meta) fail at set-up, naming the setting."""
    with torch.device("meta"):
        model = Net()
    with pytest.raises(ConfigError, match=r"no fused AdamW for trainable tensors of torch.float32 on meta.*'foreach'"):
        build_optimizer(model, _cfg("fused"))
    assert build_optimizer(model, _cfg("foreach")).defaults["foreach"]


@pytest.mark.parametrize(("saved", "resumed"), [("foreach", "fused"), ("fused", "foreach")])
def test_a_resume_runs_the_configured_implementation(tmp_path, saved, resumed):
    """A checkpoint's param_groups carry the implementation they were saved with; torch would restore it. The
    resumed run takes the configured one, and its steps continue the saved run's."""
    model = _net()
    optimizer = build_optimizer(model, _cfg(saved))
    _steps(model, optimizer, 2)
    state = TrainerState(step=2, scheduler={}, data={}, rng=capture_rng())
    path = save_checkpoint(tmp_path, model=model, optimizer=optimizer, state=state, env=ENV, keep_last=1)
    _steps(model, optimizer, 3, start=2)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}

    fresh = Net()
    optimizer = build_optimizer(fresh, _cfg(resumed))
    load_checkpoint(path, model=fresh, optimizer=optimizer, env=ENV)
    assert all(g[resumed] is True and g[saved] is None for g in optimizer.param_groups)
    _steps(fresh, optimizer, 3, start=2)
    _assert_all_close({n: p.detach() for n, p in fresh.named_parameters()}, expected)


def test_the_plan_counts_the_step_temporaries_of_the_configured_implementation():
    from vlm_sft.checks.memory_plan import plan_for_run
    from vlm_sft.config import RunConfig

    model = {"name_or_path": "Qwen/Qwen3.5-9B", "dtype": "bfloat16", "vlm": {"freeze_vision": True}}
    plans = {
        impl: plan_for_run(RunConfig(model=model, train={"device": "cuda", "optimizer_impl": impl}), 8)
        for impl in IMPLS
    }
    assert plans["fused"].optimizer_temporaries == 0
    assert plans["foreach"].optimizer_temporaries == plans["foreach"].grads > 0  # one fp32 copy of the shard
    assert plans["foreach"].training - plans["fused"].training == plans["foreach"].grads
