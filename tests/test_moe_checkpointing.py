"""MoE-safe activation checkpointing: a checkpointed MoE layer's recompute reuses the experts its forward chose.

The recompute is forced to route differently (``FlipInBackward`` replaces the top-k choice whenever it runs inside
a backward, which only a checkpoint recompute does), in two ways: ``roll`` moves every token's choice to the next
token, which keeps each expert's token count and so every saved tensor's shape (without the replay: silently
wrong gradients); ``swap`` gives token 0 its next-best expert, as a near tie flipped in bf16 would (without the
replay: torch's checkpoint sees other saved shapes and raises). With the replay the gradients equal those without
checkpointing, in float64; with it switched off (``noop_context_fn``) the same runs fail, so the tests can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from packing_helpers import make_sample, packed_batch
from torch.utils.checkpoint import CheckpointError, noop_context_fn

from vlm_sft.model import build_model, moe, text_model, tiny_qwen3_5_moe_config
from vlm_sft.model.load_balance import load_balancing_loss

COEF = 0.05


class FlipInBackward:
    """``moe.select_experts`` that picks other experts when called inside a backward (``roll`` or ``swap``, see the
    module docstring); counts those calls."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.backward_calls = 0

    def __call__(self, probs_TE: torch.Tensor, top_k: int) -> torch.Tensor:
        ranked_TE = torch.argsort(probs_TE.detach(), dim=-1, descending=True)
        experts_TK = ranked_TE[:, :top_k]
        if torch._C._current_graph_task_id() == -1:  # not in a backward: the forward's own choice
            return experts_TK
        self.backward_calls += 1
        if self.mode == "roll":
            return experts_TK.roll(1, dims=0)
        flipped_TK = experts_TK.clone()
        flipped_TK[0, -1] = ranked_TE[0, top_k]
        return flipped_TK


@pytest.fixture(scope="module")
def cfg():
    return tiny_qwen3_5_moe_config(router_aux_loss_coef=COEF)


@pytest.fixture(scope="module")
def batches(cfg):
    """Two micro-batches of packed rows (text, an image, padding)."""
    gen = torch.Generator().manual_seed(5)
    first = [[make_sample(cfg, 5, [(1, 4, 4)], 6, gen), make_sample(cfg, 12, [], 0, gen)]]
    second = [[make_sample(cfg, 20, [], 0, gen), make_sample(cfg, 9, [], 0, gen)]]
    return [packed_batch(cfg, first, 32), packed_batch(cfg, second, 32)]


@pytest.fixture
def model(cfg):
    torch.manual_seed(0)
    return build_model(cfg, dtype=torch.float64, experts_impl="sorted", freeze_vision=False)


def step_grads(model, batches, *, checkpointing: bool, prepass: bool = False, backwards: int = 1) -> dict:
    """Parameter gradients of the token loss plus the load-balancing term over ``batches``, all forwards before one
    backward; ``prepass``: first a no-grad routing pass, as the trainer's ``RouterBalance.prepass_counts``.
    ``backwards`` > 1: that many backwards on a retained graph, of a cross-entropy on the logits (the chunked loss
    takes one backward per forward)."""
    model.zero_grad(set_to_none=True)
    model.set_activation_checkpointing(checkpointing)
    if prepass:
        with torch.no_grad():
            for b in batches:
                model(**b.model_kwargs(), router_mask=b.real_mask(), routing_only=True)
    loss = 0.0
    for b in batches:
        kwargs = b.model_kwargs()
        if backwards > 1:
            targets = kwargs.pop("target_ids").masked_fill(~kwargs.pop("loss_mask"), -100)
            logits = model(**kwargs)
            loss = loss + F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            continue
        out = model(**kwargs, router_mask=b.real_mask(), router_probs_grad=True)
        router = out.router
        loss = loss + out.loss_sum + COEF * load_balancing_loss(router.counts_ME, router.probs_ME, router.tokens)
    for i in range(backwards):
        loss.backward(retain_graph=i + 1 < backwards)
    assert moe._ACTIVE_REPLAY.get() is None
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def worst_relative(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in a)


@pytest.mark.parametrize("mode", ["roll", "swap"])
def test_recompute_reuses_the_forward_routing(model, batches, monkeypatch, mode):
    flip = FlipInBackward(mode)
    monkeypatch.setattr(moe, "select_experts", flip)
    plain = step_grads(model, batches[:1], checkpointing=False)
    ckpt = step_grads(model, batches[:1], checkpointing=True)
    assert any(".mlp.experts." in k for k in plain) and any(".mlp.gate." in k for k in plain)
    assert flip.backward_calls == 0  # the recompute never chose again
    assert worst_relative(ckpt, plain) <= 1e-12


def test_replay_across_micro_batches_after_a_no_grad_prepass(model, batches, monkeypatch):
    """Two checkpointed forwards before one backward, after a no-grad routing pre-pass (which records nothing)."""
    monkeypatch.setattr(moe, "select_experts", FlipInBackward("roll"))
    plain = step_grads(model, batches, checkpointing=False, prepass=True)
    ckpt = step_grads(model, batches, checkpointing=True, prepass=True)
    assert worst_relative(ckpt, plain) <= 1e-12


def test_a_retained_graph_replays_again_on_its_second_backward(model, batches, monkeypatch):
    """Each backward on a retained graph recomputes the layers anew, and each recompute replays from the first
    MoE block of its call."""
    monkeypatch.setattr(moe, "select_experts", FlipInBackward("roll"))
    plain = step_grads(model, batches, checkpointing=False, backwards=2)
    ckpt = step_grads(model, batches, checkpointing=True, backwards=2)
    assert worst_relative(ckpt, plain) <= 1e-12


def test_without_the_replay_a_flipped_recompute_is_wrong_or_raises(model, batches, monkeypatch):
    """The guarded bug: with ``routing_replay_contexts`` switched off the flipped recompute gives other gradients
    (``roll``: same shapes) or torch's checkpoint raises (``swap``: an expert's slice changes shape)."""
    monkeypatch.setattr(text_model, "routing_replay_contexts", noop_context_fn)
    monkeypatch.setattr(moe, "select_experts", FlipInBackward("roll"))
    plain = step_grads(model, batches[:1], checkpointing=False)
    assert worst_relative(step_grads(model, batches[:1], checkpointing=True), plain) > 1e-2
    monkeypatch.setattr(moe, "select_experts", FlipInBackward("swap"))
    with pytest.raises(CheckpointError):
        step_grads(model, batches[:1], checkpointing=True)
