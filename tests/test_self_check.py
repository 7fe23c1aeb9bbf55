"""The calibrated packing self-check in bf16, its model slice, and the trainer-facing ``run_packing_check``.

In bf16 a packed sample never equals the sample alone bit for bit, so the check measures each sample's own rounding
noise (the floor: bf16 alone vs a float64 reference) and judges the packed row's error by its ratio to it.
These tests run bf16 the only way a CPU can, autocast on the pure-torch kernels, and pin both sides: the exact model
passes, and the same model with ``seq_lens`` withheld (or with only its short conv leaking) fails by a wide margin,
on the whole model and on the slice the trainer checks (``checks.slice``: a layer of each kind, one vision block, a
few experts, the rows' vocabulary). The slice of a model sharded over 2 ranks equals the slice of the same model
unsharded, bit for bit. The CUDA kernels get the same two tests in ``tests/test_packing_gpu.py``.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packing_helpers import make_sample, mixed_row, padding_segment
from torch import nn
from train_helpers import launch_env, tiny_run_args
from transformers import Qwen3_5Config

from vlm_sft.check_packing import main as check_packing_cli
from vlm_sft.checkpoint import build
from vlm_sft.checks.packing_check import RATIO_BOUND, REFERENCE_DTYPE, check_packing, exact_backends, reference_model
from vlm_sft.checks.self_check import (
    CHECK_PACK_LEN,
    CHECK_SEQ_LEN,
    check_config,
    remap_row,
    rows_vocab,
    run_packing_check,
)
from vlm_sft.checks.slice import SliceShape, build_slice, slice_config, slice_shape
from vlm_sft.config import REPO_ROOT, load_config
from vlm_sft.data import build as data_build
from vlm_sft.model import Qwen3_5VLM, build_model, tiny_qwen3_5_config, tiny_qwen3_5_moe_config
from vlm_sft.model.presets import qwen3_5_0_8b_config, qwen3_5_35b_a3b_config
from vlm_sft.model.varlen import Segments

WORKER = str(Path(__file__).resolve().parent / "slice_worker.py")

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


def sliced(model: Qwen3_5VLM, samples: list[dict], shape: SliceShape | None = None):
    """The trainer's slice of ``model`` for ``samples``, and the samples renumbered into its vocabulary."""
    vocab = rows_vocab([samples], model.config.text_config.pad_token_id)
    return build_slice(model, vocab, shape=shape), remap_row(samples, vocab)


@pytest.fixture(scope="module", params=["model", "slice"])
def checked(request, model, samples):
    """The model checked whole, or through the slice the trainer checks (its samples renumbered)."""
    return (model, samples) if request.param == "model" else sliced(model, samples)


class _IgnoresSeqLens(nn.Module):
    """The packed row run as one segment: every sample sees the ones before it."""

    def __init__(self, inner: Qwen3_5VLM) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, *, seq_lens=None, **kwargs):
        return self.inner(input_ids, **kwargs)


def test_bf16_exact_model_passes_against_its_own_noise_floor(checked):
    model, samples = checked
    report = check_packing(model, samples, compute_dtype=BF16)
    assert report.ok, report.format()
    # The floor is real bf16 noise (~1e-3 on these logits), not the float32 minimum, and the packed row's error
    # is that same noise: the ratio sits at ~1 (measured 1.00 on the logits, <= 1.1 on the gradients).
    assert report.logits.floor > 1e-4
    assert report.logits.ratio <= 2 and report.grad.ratio <= 2, report.format()
    assert max(d.ratio for d in report.ops.values()) <= 2, report.format()
    assert report.compute.startswith("bfloat16 autocast") and report.reference.startswith("float64")
    assert json.loads(json.dumps(report.to_dict()))["ok"] is True


def test_bf16_check_fails_the_same_model_with_seq_lens_withheld(checked):
    model, samples = checked
    report = check_packing(_IgnoresSeqLens(model), samples, compute_dtype=BF16)
    assert not report.ok
    assert report.logits.ratio > 10 * RATIO_BOUND and report.grad.ratio > 10 * RATIO_BOUND, report.format()
    # Every sample with a neighbour before it is named (the first one has none).
    assert min(report.per_sample_ratio[1:]) > 10 * RATIO_BOUND, report.per_sample_ratio
    for op in ("conv", "linear_attention", "attention"):
        assert report.ops[op].ratio > 10 * RATIO_BOUND, report.format()
    assert report.ops["vision"].ratio <= 2  # the vision tower runs per image: it cannot leak
    assert "FAILED" in report.format()


def test_bf16_check_catches_a_conv_that_crosses_segment_starts(checked, monkeypatch):
    """A small leak (W - 1 = 3 taps at each segment start) is still far above bf16 noise."""
    import vlm_sft.model.layers as layers

    model, samples = checked
    real_conv = layers.causal_conv1d

    def leaky_conv(x_TC, weight, bias, segments, **kwargs):
        return real_conv(x_TC, weight, bias, Segments.from_lengths([x_TC.shape[0]], x_TC.device), **kwargs)

    monkeypatch.setattr(layers, "causal_conv1d", leaky_conv)
    report = check_packing(model, samples, compute_dtype=BF16)
    assert not report.ok
    assert report.logits.ratio > 5 * RATIO_BOUND, report.format()
    assert report.ops["conv"].ratio > 10 * RATIO_BOUND and report.ops["conv"].where.endswith("conv1d")


def test_moe_slice_passes_exact_and_fails_without_seq_lens():
    """The MoE slice keeps 3 of 4 experts (top-2 of them) and 24 of the shared expert's 64 channels: routing and
    the grouped expert path still run, and a leak still shows."""
    cfg = tiny_qwen3_5_moe_config(num_experts=4)
    torch.manual_seed(0)
    moe = build_model(cfg, freeze_vision=False)
    shape = SliceShape((0, 3), 1, experts=3, top_k=2, mlp_width=24)
    part, samples = sliced(moe, mixed_row(cfg), shape)
    assert part.model.language_model.layers[0].mlp.experts.gate_up_proj.shape[0] == 3
    exact = check_packing(part, samples, compute_dtype=BF16)
    assert exact.ok and exact.logits.ratio <= 2 and exact.grad.ratio <= 2, exact.format()
    assert exact.ops["moe"].ratio <= 2, exact.format()
    leaky = check_packing(_IgnoresSeqLens(part), samples, compute_dtype=BF16)
    assert not leaky.ok and leaky.logits.ratio > 10 * RATIO_BOUND and leaky.grad.ratio > 10 * RATIO_BOUND


def test_slice_takes_the_models_weights_by_name(model, samples):
    """Slice layer j is the model's layer ``shape.layers[j]``, the vocabulary rows are those of the rows' ids, a
    narrowed MLP keeps its first channels; backends, flags and dtypes are the model's; the model is untouched."""
    shape = SliceShape((1, 3), 1, mlp_width=48)
    part, remapped = sliced(model, samples, shape)
    vocab = rows_vocab([samples], model.config.text_config.pad_token_id)
    src, got = dict(model.named_parameters()), dict(part.named_parameters())
    layers = "model.language_model.layers."
    assert torch.equal(
        got[layers + "0.linear_attn.in_proj_qkv.weight"], src[layers + "1.linear_attn.in_proj_qkv.weight"]
    )
    assert torch.equal(got[layers + "1.self_attn.q_proj.weight"], src[layers + "3.self_attn.q_proj.weight"])
    assert torch.equal(got[layers + "1.mlp.gate_proj.weight"], src[layers + "3.mlp.gate_proj.weight"][:48])
    assert torch.equal(got[layers + "1.mlp.down_proj.weight"], src[layers + "3.mlp.down_proj.weight"][:, :48])
    for name in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(got[name], src[name][vocab])
    assert torch.equal(got["model.visual.blocks.0.attn.qkv.weight"], src["model.visual.blocks.0.attn.qkv.weight"])
    assert len(part.model.visual.blocks) == 1 and part.config.text_config.layer_types == [
        "linear_attention", "full_attention",
    ]  # fmt: skip
    assert part.backends is model.backends and all(p.dtype == torch.float32 and p.requires_grad for p in got.values())
    assert all(p.data_ptr() != src[n].data_ptr() for n, p in got.items() if n in src)
    # Renumbered rows: the same tokens, read through the compact vocabulary.
    assert torch.equal(vocab[remapped[2]["input_ids"]], samples[2]["input_ids"])
    assert part.config.text_config.pad_token_id == int((vocab == model.config.text_config.pad_token_id).nonzero())
    assert len(model.model.language_model.layers) == 4 and model.config.text_config.num_hidden_layers == 4


def _meta_count(config) -> tuple[int, int]:
    """(text, vision tower) parameter counts of a model of ``config`` built on the meta device."""
    with torch.device("meta"):
        m = Qwen3_5VLM(config, exact_backends("cpu"))
    vision = sum(p.numel() for p in m.model.visual.parameters())
    return sum(p.numel() for p in m.parameters()) - vision, vision


@pytest.mark.parametrize(
    ("name", "max_share", "max_bytes"),
    [("0.8B", 0.09, 2.56e9 - 0.43e9), ("9B", 0.041, 9.41e9 - 1e9), ("35B-A3B", 0.009, 35.1e9)],
)
def test_the_slice_of_the_real_configs_is_a_small_fraction(name, max_share, max_bytes):
    """The figures of ``checks.slice``'s docstring: a slice for 4096 vocabulary ids is a few percent of the model,
    and the check's bytes (24 per trainable slice parameter, 12 per frozen one: the towers are frozen) stay within
    two fp32 gradient shards (4 S / W at W = 8; 9B: with 1 GB left for activations) for the 9B and 35B-A3B, and
    for the 0.8B within its run's peak (12 S / W in training, less the 2 S / W a rank holds at the check)."""
    configs = {
        "0.8B": qwen3_5_0_8b_config,
        "9B": lambda: Qwen3_5Config(vision_config={"out_hidden_size": 4096}, tie_word_embeddings=False),
        "35B-A3B": qwen3_5_35b_a3b_config,
    }
    config = configs[name]()
    text, vision = _meta_count(config)
    s_text, s_vision = _meta_count(slice_config(config, slice_shape(config), 4096, 0))
    assert (s_text + s_vision) / (text + vision) < max_share
    assert 24 * s_text + 12 * s_vision < max_bytes


def test_float32_check_passes_a_deep_exact_model():
    """24 layers in float32: some gradients (``A_log``, ``dt_bias``: sums that cancel) are ~1e-3 off the float64
    ones in every layout. The floor measures that; a single-segment floor alone put this exact model at 7. On the
    CI machine (torch 2.13 CPU) this model's worst gradient ratio is 2.54 (layer 0's ``A_log``), under the bound of 4
    but above the 1.6 measured when the bound was calibrated: the test holds it to the bound, not to a tighter guess."""
    cfg = tiny_qwen3_5_config(num_hidden_layers=24, initializer_range=0.02)
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    samples = []
    for _ in range(6):
        n_before = rng.randint(1, 40)
        grids = [(1, 4, 4)] if rng.random() < 0.4 else []
        samples.append(make_sample(cfg, n_before, grids, rng.randint(0, 40), gen))
    torch.manual_seed(1)
    report = check_packing(build_model(cfg, freeze_vision=False), [*samples, padding_segment(cfg, 5)])
    assert report.ok and report.grad.ratio <= RATIO_BOUND, report.format()


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
    processor = data_build.build_processor(cfg)
    renderer = data_build.build_renderer(cfg, processor)
    return args, cfg, renderer, data_build.load_sources(cfg), int(processor.tokenizer.pad_token_id)


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


@pytest.mark.parametrize("whole", [False, True])
def test_cli_prints_the_table_and_exits_0(tiny_run, capsys, caplog, whole):
    """The slice training checks by default, or ``--whole-model``: the model itself, no slice built."""
    args, *_ = tiny_run
    flags = ["--whole-model"] if whole else []
    with caplog.at_level(logging.INFO, logger="vlm_sft.checks.slice"):
        assert check_packing_cli(["--config", "configs/debug.toml", *args, "--rows", "1", *flags]) == 0
    out = capsys.readouterr().out
    assert "floor" in out and "leak" in out and "ratio" in out and ": OK" in out
    assert ("packing self-check slice" in caplog.text) != whole


def test_training_with_the_check_writes_its_report(tmp_path):
    """``train.check_packing = true``: the trainer runs the check before training and writes packing_check.json."""
    from vlm_sft.trainer.loop import train

    overrides = {"train.check_packing": True, "train.max_steps": 1, "train.warmup_steps": 0}
    train(load_config("configs/debug.toml", tiny_run_args(tmp_path, **overrides)))
    report = json.loads((tmp_path / "run" / "packing_check.json").read_text())
    assert report["ok"] is True and report["logits"]["ratio"] <= report["bound"] == RATIO_BOUND
    assert {"floor", "leak", "ratio", "where"} <= set(report["grad"])


def test_check_config_caps_long_samples_and_rows():
    """A long-context run's data is checked in samples of at most ``CHECK_SEQ_LEN`` tokens, truncated (not dropped,
    or its long samples would give no row); a run whose data fits is checked as configured."""
    cfg = load_config("configs/qwen3_5_9b_long_context.toml")
    capped = check_config(cfg).data
    assert (capped.seq_len, capped.pack_len, capped.truncation) == (CHECK_SEQ_LEN, CHECK_PACK_LEN, "truncate")
    assert cfg.data.seq_len == 131072  # the run's own config is left as it was
    small = load_config("configs/debug.toml")
    assert check_config(small) is small


def test_sharded_slice_equals_the_unsharded_one(tmp_path):
    """2 ranks over gloo, the model ``fully_shard``-ed: the slice rank 0 gets is bitwise the slice of the unsharded
    model (dense; MoE with 3 of 4 experts; LoRA over a bf16 base, narrowed MLPs everywhere; MoE under expert parallelism, 2 experts on each rank, on the
    ``(edp, ep)`` mesh), and the trainer's
    ``run_packing_check`` runs on every rank with the report on rank 0."""
    args = tiny_run_args(tmp_path)
    data_build.load_sources(load_config("configs/debug.toml", args))  # the shapes data, written once before the ranks
    env = launch_env() | {"SLICE_OUT": str(tmp_path), "SLICE_RUN": json.dumps(args)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER]
    done = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-6000:]
    for name in ("dense", "moe", "moe_ep", "lora"):
        result = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        alone, sharded = result["alone"], result["sharded"]
        assert alone["requires_grad"] == sharded["requires_grad"], name
        assert alone["tensors"].keys() == sharded["tensors"].keys(), name
        for key, value in alone["tensors"].items():
            other = sharded["tensors"][key]
            assert value.dtype == other.dtype and torch.equal(value, other), (name, key)
    assert {t.dtype for t in result["alone"]["tensors"].values()} == {torch.float32, torch.bfloat16}  # lora
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] is True and report["logits"]["ratio"] <= 2, report
