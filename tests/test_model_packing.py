"""Packing exactness: every sample of a packed row gets exactly the logits and gradients it gets alone.

The row mixes text-only, one-image and two-adjacent-image samples with segment lengths 1, 2, 3 (shorter than the
conv kernel), 64 (one GatedDeltaNet chunk), 65 (a chunk and one token) and a padding segment. The same row without
``seq_lens`` must differ by far more than the tolerance, which proves the comparison can fail.
"""

from __future__ import annotations

import json

import pytest
import torch
from packing_helpers import max_delta_per_sample, mixed_row, packed_row
from torch import nn

from vlm_sft.checks.packing_check import RATIO_BOUND, check_packing
from vlm_sft.model import Qwen3_5VLM, build_model, tiny_qwen3_5_config
from vlm_sft.model.varlen import Segments

TOL = 1e-5


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


@torch.no_grad()
def test_packed_logits_equal_each_sample_alone(model, samples):
    seq_lens = torch.tensor([len(s["input_ids"]) for s in samples])
    logits = model(**packed_row(samples), seq_lens=seq_lens)
    assert max_delta_per_sample(logits, samples, model) <= TOL


@torch.no_grad()
def test_same_row_without_seq_lens_leaks(model, samples):
    logits = model(**packed_row(samples))
    assert max_delta_per_sample(logits, samples, model) > 1e3 * TOL


def test_check_packing_ok_on_logits_gradients_and_every_op(model, samples):
    """float32: packed and alone are both ~1e-7 from the float64 reference, so the ratio is ~1 (measured <= 1.1)."""
    report = check_packing(model, samples)
    assert report.ok, report.format()
    assert report.logits.leak <= TOL and report.max_abs_delta <= TOL
    # Gradients: A_log's float32 gradient is itself ~5e-5 off the float64 one (a sum that cancels), in the sample
    # alone as much as packed: the ratio judges it, where a fixed 1e-5 would have failed an exact model.
    assert report.logits.ratio <= 2 and report.grad.ratio <= 2, report.format()
    assert set(report.ops) == {"vision", "conv", "linear_attention", "attention", "mlp"}
    assert max(d.leak for d in report.ops.values()) <= TOL, report.format()
    assert report.compute.startswith("float32") and report.reference.startswith("float64")
    # The vision tower is trainable here, so its gradients are part of the comparison.
    assert any(n.startswith("model.visual.") for n, p in model.named_parameters() if p.requires_grad)
    assert json.loads(json.dumps(report.to_dict()))["logits"]["ratio"] == report.logits.ratio


class _IgnoresSeqLens(nn.Module):
    """A deliberately broken model: drops ``seq_lens`` so packed samples see each other."""

    def __init__(self, inner: Qwen3_5VLM) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, *, seq_lens=None, **kwargs):
        return self.inner(input_ids, **kwargs)


def test_check_packing_flags_a_model_that_ignores_seq_lens(model, samples):
    report = check_packing(_IgnoresSeqLens(model), samples)
    assert not report.ok
    assert report.logits.leak > 1e3 * TOL and report.grad.leak > 1e3 * TOL
    assert report.logits.ratio > 1e3 * RATIO_BOUND and report.grad.ratio > 1e3 * RATIO_BOUND
    # Only the first sample (nothing before it) is unaffected; every later one is named by its ratio.
    assert report.per_sample_ratio[0] <= 1 and min(report.per_sample_ratio[1:]) > RATIO_BOUND
    # The leak starts in the token mixers; the vision tower (per image) stays exact.
    for op in ("conv", "linear_attention", "attention"):
        assert report.ops[op].ratio > 100 * RATIO_BOUND, report.format()
    assert report.ops["vision"].leak <= TOL
    assert "FAILED" in report.format()


def test_check_packing_names_the_leaking_op(model, samples, monkeypatch):
    """Only the short conv ignores segment starts: the conv class shows the leak, the vision tower none."""
    import vlm_sft.model.layers as layers

    real_conv = layers.causal_conv1d

    def leaky_conv(x_TC, weight, bias, segments, **kwargs):
        whole = Segments.from_lengths([x_TC.shape[0]], x_TC.device)
        return real_conv(x_TC, weight, bias, whole, **kwargs)

    monkeypatch.setattr(layers, "causal_conv1d", leaky_conv)
    report = check_packing(model, samples)
    assert not report.ok
    assert report.ops["conv"].ratio > 100 * RATIO_BOUND
    assert report.ops["conv"].where.endswith("linear_attn.conv1d")
    assert report.ops["vision"].leak <= TOL
