"""The calibrated packing self-check in bf16, and the trainer-facing ``run_packing_check`` on the tiny run's data.

In bf16 a packed sample never equals the sample alone bit for bit, so the check measures each sample's own rounding
noise (the floor: bf16 alone vs a float64 reference) and judges the packed row's error by its ratio to it.
These tests run bf16 the only way a CPU can, autocast on the pure-torch kernels, and pin both sides: the exact model
passes, and the same model with ``seq_lens`` withheld (or with only its short conv leaking) fails by a wide margin.
The CUDA kernels get the same two tests in ``tests/test_packing_gpu.py``.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from packing_helpers import make_sample, mixed_row, padding_segment
from torch import nn
from train_helpers import tiny_run_args

from vlm_sft.check_packing import main as check_packing_cli
from vlm_sft.config import load_config
from vlm_sft.model import Qwen3_5VLM, build_model, tiny_qwen3_5_config
from vlm_sft.model.packing_check import RATIO_BOUND, REFERENCE_DTYPE, check_packing, exact_backends, reference_model
from vlm_sft.model.varlen import Segments
from vlm_sft.trainer import build
from vlm_sft.trainer.self_check import run_packing_check

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def cfg():
    return tiny_qwen3_5_config()


@pytest.fixture(scope="module")
def samples(cfg):
    return mixed_row(cfg)


@pytest.fixture(scope="module")
def model(cfg):
    torch.manual_seed(0)
    return build_model(cfg, freeze_vision=False)


class _IgnoresSeqLens(nn.Module):
    """The packed row run as one segment: every sample sees the ones before it."""

    def __init__(self, inner: Qwen3_5VLM) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, *, seq_lens=None, **kwargs):
        return self.inner(input_ids, **kwargs)


def test_bf16_exact_model_passes_against_its_own_noise_floor(model, samples):
    report = check_packing(model, samples, compute_dtype=BF16)
    assert report.ok, report.format()
    # The floor is real bf16 noise (~1e-3 on these logits), not the float32 minimum, and the packed row's error
    # is that same noise: the ratio sits at ~1 (measured 1.00 on the logits, <= 1.1 on the gradients).
    assert report.logits.floor > 1e-4
    assert report.logits.ratio <= 2 and report.grad.ratio <= 2, report.format()
    assert max(d.ratio for d in report.ops.values()) <= 2, report.format()
    assert report.compute.startswith("bfloat16 autocast") and report.reference.startswith("float64")
    assert json.loads(json.dumps(report.to_dict()))["ok"] is True


def test_bf16_check_fails_the_same_model_with_seq_lens_withheld(model, samples):
    report = check_packing(_IgnoresSeqLens(model), samples, compute_dtype=BF16)
    assert not report.ok
    assert report.logits.ratio > 10 * RATIO_BOUND and report.grad.ratio > 10 * RATIO_BOUND, report.format()
    # Every sample with a neighbour before it is named (the first one has none).
    assert min(report.per_sample_ratio[1:]) > 10 * RATIO_BOUND, report.per_sample_ratio
    for op in ("conv", "linear_attention", "attention"):
        assert report.ops[op].ratio > 10 * RATIO_BOUND, report.format()
    assert report.ops["vision"].ratio <= 2  # the vision tower runs per image: it cannot leak
    assert "FAILED" in report.format()


def test_bf16_check_catches_a_conv_that_crosses_segment_starts(model, samples, monkeypatch):
    """A small leak (W - 1 = 3 taps at each segment start) is still far above bf16 noise."""
    import vlm_sft.model.layers as layers

    real_conv = layers.causal_conv1d

    def leaky_conv(x_TC, weight, bias, segments, **kwargs):
        return real_conv(x_TC, weight, bias, Segments.from_lengths([x_TC.shape[0]], x_TC.device), **kwargs)

    monkeypatch.setattr(layers, "causal_conv1d", leaky_conv)
    report = check_packing(model, samples, compute_dtype=BF16)
    assert not report.ok
    assert report.logits.ratio > 5 * RATIO_BOUND, report.format()
    assert report.ops["conv"].ratio > 10 * RATIO_BOUND and report.ops["conv"].where.endswith("conv1d")


def test_float32_check_passes_a_deep_exact_model():
    """24 layers in float32: some gradients (``A_log``, ``dt_bias``: sums that cancel) are ~1e-3 off the float64
    ones in every layout. The floor measures that; a single-segment floor alone put this exact model at 7."""
    cfg = tiny_qwen3_5_config(num_hidden_layers=24, initializer_range=0.02)
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    samples = []
    for _ in range(6):
        n_before = rng.randint(1, 40)
        grids = [(1, 4, 4)] if rng.random() < 0.4 else []
        samples.append(make_sample(cfg, n_before, grids, rng.randint(0, 40), gen))
    torch.manual_seed(1)
    report = check_packing(build_model(cfg, freeze_vision=False), [*samples, padding_segment(cfg, 5)])
    assert report.ok and report.grad.ratio <= 2, report.format()


def test_reference_is_a_float64_copy_on_the_exact_kernels(model, samples):
    ref = reference_model(model)
    assert ref.backends == exact_backends("cpu")
    assert {p.dtype for p in ref.parameters()} == {REFERENCE_DTYPE}
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.double(), q) and p.data_ptr() != q.data_ptr(), name
    own = model.backends
    check_packing(model, samples[:2], compute_dtype=BF16)
    # The checked model is left as it was: its kernels, its float32 weights, no .grad written.
    assert model.backends is own
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())


def test_check_packing_needs_float32_master_weights(cfg, samples):
    with pytest.raises(ValueError, match="float32 parameters"):
        check_packing(build_model(cfg, dtype=BF16), samples[:2], compute_dtype=BF16)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny default run's config on a small shapes set (``tiny_run_args``), and its renderer, data and pad id."""
    tmp = tmp_path_factory.mktemp("self_check")
    args = tiny_run_args(tmp)
    cfg = load_config("configs/debug.toml", args)
    processor = build.build_processor(cfg)
    renderer = build.build_renderer(cfg, processor)
    return args, cfg, renderer, build.load_sources(cfg), int(processor.tokenizer.pad_token_id)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_run_packing_check_on_the_tiny_run_is_ok(tiny_run, dtype):
    _, cfg, renderer, sources, pad_id = tiny_run
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": dtype})})
    model = build.build_model(cfg, torch.device("cpu"))
    report = run_packing_check(cfg, model=model, renderer=renderer, source=sources.train, pad_id=pad_id, rows=1)
    assert report.ok, report.format()
    assert len(report.seq_lens) >= 3 and report.seq_lens[-1] == 8  # real samples, then the padding segment
    assert ("bfloat16" in report.compute) == (dtype == "bfloat16")
    json.dumps(report.to_dict())  # what the trainer writes to packing_check.json


def test_cli_prints_the_table_and_exits_0(tiny_run, capsys):
    args, *_ = tiny_run
    assert check_packing_cli(["--config", "configs/debug.toml", *args, "--rows", "1"]) == 0
    out = capsys.readouterr().out
    assert "floor" in out and "leak" in out and "ratio" in out and ": OK" in out


def test_training_with_the_check_writes_its_report(tmp_path):
    """``train.check_packing = true``: the trainer runs the check before training and writes packing_check.json."""
    from vlm_sft.trainer.loop import train

    overrides = {"train.check_packing": True, "train.max_steps": 1, "train.warmup_steps": 0}
    train(load_config("configs/debug.toml", tiny_run_args(tmp_path, **overrides)))
    report = json.loads((tmp_path / "run" / "packing_check.json").read_text())
    assert report["ok"] is True and report["logits"]["ratio"] <= report["bound"] == RATIO_BOUND
    assert {"floor", "leak", "ratio", "where"} <= set(report["grad"])
