"""Packed vs alone at the model level on the CUDA kernels, judged by the calibrated packing check (``gpu`` marker).

``tests/test_kernels_gpu.py`` compares each CUDA kernel with its torch reference; this file runs the whole model on
the backends ``resolve_backends("cuda")`` picks (flash-linear-attention GatedDeltaNet and conv, flash-attn or torch's
varlen attention, fla's fused loss) under bf16 autocast, as training does, and asks ``check_packing`` whether every
sample of a packed row gets what it gets alone, up to its own bf16 noise (floor: the sample alone vs a float64
reference on the pure-torch kernels). The same check must fail when the row is run without ``seq_lens``, so it can
fail. The body is small but the heads are Qwen3.5's: 8 query / 2 kv heads of 256 with 64 rotary dims in MRoPE
[11, 11, 10]; GatedDeltaNet 16 key heads repeated to 32 value heads (9B's layout), all of 128.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from packing_helpers import make_sample, padding_segment
from torch import nn

from vlm_sft.checks.packing_check import RATIO_BOUND, check_packing
from vlm_sft.model import Qwen3_5VLM, build_model, tiny_qwen3_5_config

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BF16 = torch.bfloat16


def real_heads_config(hidden_size: int = 256):
    """The tiny preset (4 layers: 3 GatedDeltaNet, 1 attention; tiny vocabulary and vision tower) with real heads."""
    cfg = tiny_qwen3_5_config(hidden_size=hidden_size)
    t = cfg.text_config
    t.num_attention_heads, t.num_key_value_heads, t.head_dim = 8, 2, 256
    t.linear_num_key_heads, t.linear_num_value_heads = 16, 32
    t.linear_key_head_dim = t.linear_value_head_dim = 128
    t.rope_parameters = {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }
    return cfg


def packed_samples(cfg) -> list[dict]:
    """CPU samples of 1, 2, 17, 3, 17, 64, 65 and 130 tokens (one or two images in three of them), then padding:
    segments shorter than the conv kernel, exactly one fla chunk, a chunk and one token, three chunks."""
    gen = torch.Generator().manual_seed(3)
    out = [
        make_sample(cfg, 1, [], 0, gen),
        make_sample(cfg, 2, [], 0, gen),
        make_sample(cfg, 5, [(1, 4, 4)], 6, gen),
        make_sample(cfg, 3, [], 0, gen),
        make_sample(cfg, 4, [(1, 2, 4), (1, 4, 2)], 5, gen),
        make_sample(cfg, 64, [], 0, gen),
        make_sample(cfg, 52, [(1, 4, 6)], 5, gen),
        make_sample(cfg, 130, [], 0, gen),
        padding_segment(cfg, 9),
    ]
    assert [len(s["input_ids"]) for s in out] == [1, 2, 17, 3, 17, 64, 65, 130, 9]
    return out


class _IgnoresSeqLens(nn.Module):
    """The packed row run as one segment: every sample sees the ones before it."""

    def __init__(self, inner: Qwen3_5VLM) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, *, seq_lens=None, **kwargs):
        return self.inner(input_ids, **kwargs)


@pytest.fixture(scope="module")
def cfg():
    return real_heads_config()


@pytest.fixture(scope="module")
def samples(cfg):
    return packed_samples(cfg)


@pytest.fixture(scope="module")
def model(cfg):
    torch.manual_seed(0)
    return build_model(cfg, device=DEVICE, freeze_vision=False)  # backends: "auto", the fastest installed


def test_the_model_runs_on_the_fast_kernels_that_are_installed(model):
    chosen = model.backends
    if importlib.util.find_spec("fla") and importlib.util.find_spec("triton"):
        assert (chosen.linear_attention, chosen.conv, chosen.loss) == ("fla", "fla", "fla_fused")
    if importlib.util.find_spec("flash_attn"):
        assert chosen.attention == "flash_attn"
    else:
        assert chosen.attention in ("torch_varlen", "sdpa")


def test_bf16_packed_row_passes_the_calibrated_check(model, samples):
    report = check_packing(model, samples, compute_dtype=BF16)
    print(report.format())
    assert report.ok, report.format()
    assert report.logits.floor > 0 and report.grad.floor > 0


def test_bf16_check_fails_the_same_model_with_seq_lens_withheld(model, samples):
    report = check_packing(_IgnoresSeqLens(model), samples, compute_dtype=BF16)
    print(report.format())
    assert not report.ok
    assert report.logits.ratio > 10 * RATIO_BOUND and report.grad.ratio > 10 * RATIO_BOUND, report.format()
    assert min(report.per_sample_ratio[1:]) > RATIO_BOUND, report.per_sample_ratio


def test_float32_run_on_the_bf16_kernels_passes_too(model, samples):
    """``model.dtype = "float32"`` on CUDA still runs fla / flash in bf16 inside: the floor measures that noise, where
    a float32 tolerance would fail the run."""
    report = check_packing(model, samples[:6], compute_dtype=None)
    print(report.format())
    assert report.ok, report.format()
