"""Qwen3.5-MoE in the trainer: the load-balancing loss (transformers' value; defined on the whole step, so the
micro-batch and rank split does not change it), routing metrics, the packing self-check, and FSDP2 runs where
2 ranks x 2 micro-batches equal 1 rank x 4."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from packing_helpers import make_sample, mixed_row, packed_batch
from safetensors.torch import load_file
from train_helpers import LEARNING_CHECK, Background, deterministic, read_metrics, run_training, tiny_run_args
from transformers import Qwen3_5MoeForConditionalGeneration

from vlm_sft.checks.packing_check import check_packing
from vlm_sft.config import ConfigError
from vlm_sft.model import build_model, tiny_qwen3_5_config, tiny_qwen3_5_moe_config
from vlm_sft.model.load_balance import load_balancing_loss
from vlm_sft.parallel.env import DistEnv
from vlm_sft.trainer.router_balance import RouterBalance

COEF = 0.05
ROUTER = "model.language_model.layers.{}.mlp.gate.weight"
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def cfg():
    return tiny_qwen3_5_moe_config(router_aux_loss_coef=COEF)


@pytest.fixture(scope="module")
def rows(cfg):
    """Four packed rows of 40 tokens: text, images, and a padding segment in three of them."""
    gen = torch.Generator().manual_seed(3)
    return [
        [make_sample(cfg, 5, [(1, 4, 4)], 6, gen), make_sample(cfg, 12, [], 0, gen)],
        [make_sample(cfg, 30, [], 0, gen), make_sample(cfg, 10, [], 0, gen)],
        [make_sample(cfg, 4, [(1, 2, 4), (1, 4, 2)], 5, gen)],
        [make_sample(cfg, 7, [], 0, gen), make_sample(cfg, 3, [(1, 4, 4)], 2, gen)],
    ]


def test_real_mask_covers_the_samples_and_not_the_padding(cfg, rows):
    batch = packed_batch(cfg, rows, length=40)
    mask = batch.real_mask()
    assert int(mask.sum()) == batch.num_real_tokens < mask.numel()
    assert mask[1].all() and not mask[0, -11:].any() and mask[0, :-11].all()


def test_aux_loss_and_router_gradients_equal_transformers_on_an_unpacked_batch(cfg):
    """One sample per row, right padding excluded through the mask, as transformers' attention mask does."""
    torch.manual_seed(0)
    ref = Qwen3_5MoeForConditionalGeneration(cfg)
    ref.set_experts_implementation("eager")
    ours = build_model(cfg)
    ours.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(0)
    batch = packed_batch(cfg, [[make_sample(cfg, 5, [(1, 4, 4)], 6, gen)], [make_sample(cfg, 9, [], 0, gen)]], 17)
    real = batch.real_mask()
    theirs = ref(
        input_ids=batch.input_ids, attention_mask=real.long(), pixel_values=batch.pixel_values,
        image_grid_thw=batch.image_grid_thw, mm_token_type_ids=batch.mm_token_type_ids, output_router_logits=True,
    )  # fmt: skip
    theirs.aux_loss.backward()
    out = ours(**batch.model_kwargs(), router_mask=real, router_probs_grad=True)
    aux = load_balancing_loss(out.router.counts_ME, out.router.probs_ME, out.router.tokens)
    aux.backward()
    assert float(aux.detach()) == pytest.approx(float(theirs.aux_loss.detach()), rel=1e-6)
    grads = dict(ref.named_parameters())
    for layer in range(cfg.text_config.num_hidden_layers):
        mine, their = ours.get_parameter(ROUTER.format(layer)).grad, grads[ROUTER.format(layer)].grad
        assert float(their.norm()) > 0
        assert float((mine - their).norm()) <= 1e-5 * float(their.norm())
    # Padding counts in the statistics only through the mask: counting every token gives another loss.
    unmasked = ours(**batch.model_kwargs()).router
    assert abs(float(load_balancing_loss(unmasked.counts_ME, unmasked.probs_ME, unmasked.tokens)) - float(aux)) > 1e-4


def _step_grads(model, batches, balance: RouterBalance, *, local: bool = False) -> dict[str, torch.Tensor]:
    """The gradient of one optimizer step as the trainer forms it (one rank): token loss over the step's trainable
    tokens plus each micro-batch's share of the step's aux loss. ``local``: the per-micro-batch definition instead
    (each micro-batch's own counts and tokens), which depends on the split."""
    model.zero_grad(set_to_none=True)
    trainable, real = sum(b.num_trainable_tokens for b in batches), sum(b.num_real_tokens for b in batches)
    counts = balance.prepass_counts(model, batches, CPU) if len(batches) > 1 and not local else None
    for b in batches:
        out = model(**b.model_kwargs(), **balance.forward_kwargs(b))
        tokens = b.num_real_tokens if local else real
        (out.loss_sum / trainable + balance.aux_term(out.router, counts, tokens, CPU)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


FP32_DECAY = ("linear_attn.A_log", "linear_attn.dt_bias")
"""The GatedDeltaNet decay computes in float32 even in a float64 model (as in transformers); its parameters'
gradients are sums that cancel (see test_model_packing.py), ~2e-5 relative apart between splits, aux loss or not."""


def _worst_relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest ||a - b|| / ||b|| over parameters; the float32 decay parameters count at a tenth."""
    assert a.keys() == b.keys()
    weight = {k: 0.1 if k.endswith(FP32_DECAY) else 1.0 for k in a}
    return max(weight[k] * float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in a)


def test_aux_gradient_is_the_same_for_any_micro_batch_split(cfg, rows):
    """One micro-batch of 4 rows (counts from its own forward) == 2 of 2 rows (counts from the routing pre-pass)
    == 4 of 1 row; the per-micro-batch loss the others compute differs on the routers, and the aux term matters.
    In float64, where every other gradient agrees to ~1e-6 (``FP32_DECAY``)."""
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float64, experts_impl="sorted")  # grouped_mm has no float64
    balance = RouterBalance.for_model(model, None, log=False)
    assert balance.coef == COEF and balance.num_layers == cfg.text_config.num_hidden_layers
    whole = _step_grads(model, [packed_batch(cfg, rows, 40)], balance)
    halves = _step_grads(model, [packed_batch(cfg, rows[:2], 40), packed_batch(cfg, rows[2:], 40)], balance)
    singles = [packed_batch(cfg, [r], 40) for r in rows]
    assert _worst_relative(halves, whole) <= 1e-5
    assert _worst_relative(_step_grads(model, singles, balance), whole) <= 1e-5
    router = ROUTER.format(0)
    local = _step_grads(model, singles, balance, local=True)
    assert float((local[router] - whole[router]).norm()) > 1e-3 * float(whole[router].norm())
    off = _step_grads(model, [packed_batch(cfg, rows, 40)], RouterBalance(0.0, balance.num_layers, 4))
    assert float((off[router] - whole[router]).norm()) > 1e-3 * float(whole[router].norm())


def test_packed_gradients_equal_each_sample_alone_and_differ_without_seq_lens(cfg, rows):
    """The loss sum of one packed row (text, images, padding) has the gradients of its samples' losses run alone,
    to 1e-5 relative per parameter (float64, sorted experts); the same row without ``seq_lens`` does not."""
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float64, experts_impl="sorted", freeze_vision=False)
    samples = [s for row in rows for s in row][:5]
    packed = packed_batch(cfg, [samples], sum(len(s["input_ids"]) for s in samples) + 6)

    def grads(batches) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        sum(model(**b.model_kwargs()).loss_sum for b in batches).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    alone = grads([packed_batch(cfg, [[s]], len(s["input_ids"])) for s in samples])
    assert any(k.startswith("model.visual.") for k in alone) and any(".mlp.experts." in k for k in alone)
    assert _worst_relative(grads([packed]), alone) <= 1e-5
    leaky = dataclasses.replace(packed, seq_lens=None)
    assert _worst_relative(grads([leaky]), alone) > 1e-2


def test_router_aux_loss_coef_is_refused_on_a_dense_model():
    dense = build_model(tiny_qwen3_5_config())
    assert RouterBalance.for_model(dense, None) is None
    with pytest.raises(ConfigError, match="dense model"):
        RouterBalance.for_model(dense, 0.01)


def test_packing_check_covers_the_moe_blocks(cfg):
    """Logits, gradients and every op class of the MoE model, the routed-expert blocks included."""
    torch.manual_seed(0)
    model = build_model(cfg, freeze_vision=False)
    report = check_packing(model, mixed_row(cfg))
    assert report.ok, report.format()
    assert {"moe", "mlp", "attention", "linear_attention", "conv", "vision"} <= set(report.ops)
    assert report.ops["moe"].leak <= 1e-5 and report.logits.leak <= 1e-5
    assert report.grad.ratio <= 2, report.format()


# ------------------------------------------------------------------------------------------- FSDP2 runs


def _moe_args(tmp, **overrides):
    return tiny_run_args(tmp, **{"model.name_or_path": "tiny-moe", "model.router_aux_loss_coef": COEF, **overrides})


@pytest.fixture(scope="module")
def moe_rank_runs(tmp_path_factory):
    """Side by side: 1 process with 2 data workers x 4 micro-batches, and 2 processes x 2 micro-batches, both with
    the load-balancing loss on (so both run the routing pre-pass)."""
    one, two = tmp_path_factory.mktemp("moe_one"), tmp_path_factory.mktemp("moe_two")
    two_ranks = Background(_moe_args(two, **{"train.micro_batches": 2}), nproc=2)
    run_training(_moe_args(one, **{"train.micro_batches": 4, "data.num_workers": 2}))
    two_ranks.wait()
    return one / "run", two / "run"


def test_moe_two_ranks_equal_one_rank_with_more_micro_batches(moe_rank_runs):
    one, two = (read_metrics(d) for d in moe_rank_runs)
    a, b = deterministic(one), deterministic(two)
    assert [r["step"] for r in a] == [1, 2] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra["real_tokens"] == rb["real_tokens"]
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5, abs=1e-6)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
    logged = [[r for r in m if "loss" in r] for m in (one, two)]
    for ra, rb in zip(*logged, strict=True):
        assert ra["aux_loss"] == pytest.approx(rb["aux_loss"], rel=1e-5) and ra["aux_loss"] > 0
        for key in ("tokens_per_expert_min", "tokens_per_expert_max", "tokens_per_expert_cv"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6), key
        assert ra["tokens_per_expert_max"] >= ra["tokens_per_expert_min"] > 0
    wa, wb = (load_file(d / "final" / "model.safetensors") for d in moe_rank_runs)
    assert wa.keys() == wb.keys() and any(".mlp.experts.3.down_proj.weight" in k for k in wa)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 2e-4  # as the dense test (test_train.py)


def test_moe_final_checkpoint_loads_in_transformers(moe_rank_runs):
    _, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(moe_rank_runs[0] / "final", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.skipif(not os.environ.get(LEARNING_CHECK), reason=f"learning check: set {LEARNING_CHECK}=1 (~4 min)")
def test_default_size_moe_run_learns_the_colour_task_with_balanced_experts(tmp_path):
    """``configs/debug_moe.toml`` as it is (600 steps, the load-balancing loss at 0.01). Measured: colour accuracy
    95% at step 200 and 100% at 400 and 600; tokens per expert between about 340 and 1020 of a mean of 640 per layer
    (cv 0.12-0.22), ``aux_loss`` 2.00 (top-k: balanced) throughout."""
    args = ["--config", "configs/debug_moe.toml", "--train.output_dir", str(tmp_path / "run")]
    run_training([*args, "--data.shapes.root", str(tmp_path / "shapes")], timeout=1200)
    records = read_metrics(tmp_path / "run")
    evals = [r for r in records if "eval_acc_colour" in r]
    assert evals[-1]["step"] == 600 and evals[-1]["eval_acc_colour"] >= 0.8, evals
    routing = [r for r in records if "tokens_per_expert_cv" in r]
    assert (
        max(r["tokens_per_expert_cv"] for r in routing) < 0.5 and min(r["tokens_per_expert_min"] for r in routing) > 0
    )
