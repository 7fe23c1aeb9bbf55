"""Context parallelism (Ulysses) on CPU over gloo: one packed row split over 2 ranks gives the logits, loss and every
gradient of the whole row on one rank; the vision work is split; head counts that cannot split are refused; the
trainer with cp 2 trains exactly as without (1 CP group vs 1 rank, 2 DP x 2 CP vs 2 DP), mixed modalities included."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import _image_row, _text_row, _write_rows
from train_helpers import Background, launch_env, read_metrics, tiny_run_args

from vlm_sft.config import REPO_ROOT, ConfigError, load_config
from vlm_sft.model import build_model, tiny_qwen3_5_config
from vlm_sft.model.presets import qwen3_5_0_8b_config
from vlm_sft.model.sequence_split import check_heads, kv_heads_layout, split_images
from vlm_sft.parallel.context_parallel import NO_CP, ContextParallel
from vlm_sft.parallel.env import DistEnv
from vlm_sft.parallel.mesh import build_mesh
from vlm_sft.parallel.parallelize import apply_context_parallel, context_parallel_off, token_mixers

WORKER = str(Path(__file__).resolve().parent / "cp_worker.py")


@pytest.fixture(scope="module")
def cp_launch(tmp_path_factory) -> Path:
    """One 2-process launch of ``cp_worker.py`` for both models."""
    out = tmp_path_factory.mktemp("cp_model")
    env = launch_env() | {"CP_OUT": str(out)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER]
    done = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-6000:]
    return out


@pytest.fixture(params=["dense", "moe"])
def cp_results(request, cp_launch):
    return [torch.load(cp_launch / f"{request.param}-rank{r}.pt", weights_only=False) for r in range(2)]


def test_cp2_equals_the_whole_row_on_one_rank(cp_results):
    """Per-token logits within 1e-5 and every parameter's gradient within 1e-5 of its norm; the row has a sample
    straddling the shard cut with its image slots on both sides of it, a second image and padding.

    The exception is a gradient that float32 cannot give to 1e-5 on one rank either: the GatedDeltaNet decay's
    (``dt_bias``, ``A_log``: sums over every token that cancel, in float32 whatever the model dtype), measured 3e-5
    apart. Those must be within twice the whole row's own float32 error, against a float64 run."""
    for result in cp_results:
        (logits1, loss1, grads1), (logits2, loss2, grads2) = result["whole"], result["cp"]
        grads64 = result["float64"][2]
        scale = float(logits1.abs().max())
        assert logits2.shape == logits1.shape and scale > 0.1
        assert float((logits2 - logits1).abs().max()) <= 1e-5 * scale
        assert float(loss2) == pytest.approx(float(loss1), rel=1e-6)
        assert grads2.keys() == grads1.keys() and any(k.startswith("model.visual.") for k in grads1)
        for name, g in grads1.items():
            delta, floor = float((grads2[name] - g).norm()), float((g.double() - grads64[name]).norm())
            assert delta <= max(1e-5 * float(g.norm()), 2 * floor), (name, delta, floor)
            if delta > 1e-5 * float(g.norm()):
                assert name.endswith(("linear_attn.dt_bias", "linear_attn.A_log")), name


def test_each_cp_rank_encodes_its_share_of_the_images(cp_results):
    """The row's two images (16 and 32 patches) go to different ranks: no rank encodes them all."""
    patches = [r["patches"][-2:] for r in cp_results]  # the cp run's forwards (with and without targets)
    grid = cp_results[0]["grid"]
    assert [int(n) for n in grid.prod(-1)] == [16, 32]
    assert patches == [[16, 16], [32, 32]]


DECAY = ("linear_attn.dt_bias", "linear_attn.A_log", "linear_attn.in_proj_a.weight")
"""The GatedDeltaNet decay's parameters: gradients summed over every token that cancel, so float32 gives them to
1e-5 of their norm neither whole nor in parts (measured here: ``in_proj_a.weight`` 1.6e-5 of its norm apart)."""


def test_cp2_with_a_video_equals_each_sample_alone(cp_launch):
    """A row rendered and packed as the data path does (a committed clip as 2 temporal groups, the second straddling
    the cut at 51; an image; text; padding) under cp 2: each sample's logits within 1e-5 of it run alone, the loss
    the sum of theirs, every gradient the sum of theirs within 1e-5 of its norm (the decay's within twice the whole
    row's own float32 error), and the three vision items split between the ranks."""
    results = [torch.load(cp_launch / f"video-rank{r}.pt", weights_only=False) for r in range(2)]
    mm, seq_lens = results[0]["mm_token_type_ids"][0], results[0]["seq_lens"].tolist()
    assert seq_lens == [26, 48, 25, 3] and mm[50:54].tolist() == [2] * 4 and (mm == 1).any()
    assert [int(n) for n in results[0]["grid"].prod(-1)] == [16, 16, 16]
    assert sorted(r["patches"][-1] for r in results) == [16, 32]  # the cp forwards: a group; a group and the image
    for result in results:
        logits, loss, grads = result["cp"]
        grads64, alone = result["float64"][2], result["alone"]
        scale, start = float(logits.abs().max()), 0
        assert scale > 0.1
        for (own, _, _), n in zip(alone, seq_lens, strict=False):  # the padding segment has no sample
            assert float((logits[start : start + n] - own).abs().max()) <= 1e-5 * scale
            start += n
        assert float(loss) == pytest.approx(sum(float(a[1]) for a in alone), rel=1e-6)
        assert any(k.startswith("model.visual.") for k in grads)
        for name, g in grads.items():
            total = sum(a[2][name] for a in alone if name in a[2])
            delta, floor = float((g - total).norm()), float((result["whole"][2][name].double() - grads64[name]).norm())
            assert delta <= max(1e-5 * float(total.norm()), 2 * floor), (name, delta, floor)
            if delta > 1e-5 * float(total.norm()):
                assert name.endswith(DECAY), name


def test_split_images_keeps_each_rank_within_its_share_plus_one_image():
    for patches, size in [([16, 32], 2), ([4] * 10, 4), ([100, 1, 1, 1], 2), ([8], 4), ([], 2), ([5, 7, 9, 11, 13], 3)]:
        blocks = split_images(patches, size)
        assert len(blocks) == size and blocks[0][0] == 0 and blocks[-1][1] == len(patches)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
        share, largest = sum(patches) / size, max(patches, default=0)
        assert all(sum(patches[s:e]) <= share + largest for s, e in blocks)


def test_kv_heads_split_repeat_or_are_refused():
    assert kv_heads_layout(4, 2) == 1 and kv_heads_layout(2, 4) == 2 and kv_heads_layout(2, 8) == 4
    with pytest.raises(ValueError, match="cp_size"):
        kv_heads_layout(4, 6)


def test_head_counts_that_do_not_split_are_refused_with_the_fix():
    model = build_model(tiny_qwen3_5_config())  # 2 query heads, GatedDeltaNet 2 key / 4 value heads
    with pytest.raises(ValueError, match="does not divide linear_num_key_heads = 2"):
        apply_context_parallel(model, ContextParallel(None, 0, 4))
    apply_context_parallel(model, ContextParallel(None, 0, 2))
    assert model.context_parallel.size == 2


def test_cp_wraps_the_token_mixers_on_the_instance_and_off_unwraps_them():
    """CP replaces each token mixer's ``forward`` on the instance only (the module tree and the parameter names, which
    checkpoints, FSDP2 and DCP key on, stay); a refused size changes nothing; ``context_parallel_off`` and ``NO_CP``
    restore the class's forward: the whole row runs as on a model that never had CP (a mixer left wrapped would call
    an all-to-all on no process group and fail)."""
    torch.manual_seed(0)
    model = build_model(tiny_qwen3_5_config())
    names, mixers = [n for n, _ in model.named_parameters()], token_mixers(model)
    ids = torch.randint(0, 100, (1, 16))
    kwargs = dict(position_ids=torch.arange(16).expand(3, 1, 16))
    with torch.no_grad():
        whole = model(ids, **kwargs)
    with pytest.raises(ValueError, match="does not divide"):
        apply_context_parallel(model, ContextParallel(None, 0, 4))
    assert not model.context_parallel.active and not any("forward" in vars(m) for m in mixers)
    cp = ContextParallel(None, 0, 2)
    apply_context_parallel(model, cp)
    assert len(mixers) == 4 and all("forward" in vars(m) for m in mixers) and model.context_parallel is cp
    assert [n for n, _ in model.named_parameters()] == names
    with context_parallel_off(model), torch.no_grad():
        assert not any("forward" in vars(m) for m in mixers) and not model.context_parallel.active
        assert torch.equal(model(ids, **kwargs), whole)
    assert all("forward" in vars(m) for m in mixers) and model.context_parallel is cp
    apply_context_parallel(model, NO_CP)
    assert not any("forward" in vars(m) for m in mixers) and model.context_parallel is NO_CP


def test_layouts_that_cannot_split_evenly_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"data\.pack_len a multiple of 3"):
        load_config("configs/debug.toml", ["--train.cp_size", "3"])  # pack_len 1280
    with pytest.raises(ConfigError, match=r"use data\.packing 'bfd' or 'cat'"):
        load_config("configs/debug.toml", ["--train.cp_size", "2", "--data.packing", "stack"])
    assert load_config("configs/debug.toml", ["--train.cp_size", "2"]).train.cp_size == 2
    three_ranks = DistEnv(rank=0, world_size=3, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="launch a multiple of 2 processes"):
        build_mesh(three_ranks, cp_size=2)


# ------------------------------------------------------------------------------------------- the trainer


def _mixed_data(folder: Path) -> Path:
    """Rows for 2 data-parallel ranks (unshuffled, one row per pack: DP rank r packs rows r, r + 2, ...): in step 1
    DP rank 0's row is text only and rank 1's has an image; in step 2 two images vs one."""
    rows = []
    for step, pair in enumerate([(0, 1), (2, 1)]):
        for rank, n in enumerate(pair):
            rows.append(_image_row(folder, f"s{step}r{rank}", n) if n else _text_row())
    path = folder / "mixed.jsonl"
    _write_rows(path, rows)
    return path


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory) -> dict[str, Path]:
    """Four runs side by side on the same mixed-modality rows, 2 steps each: 1 rank; 2 ranks as one CP group with
    activation checkpointing; 2 DP x 1 CP and 2 DP x 2 CP (4 processes), both LoRA."""
    folder = tmp_path_factory.mktemp("cp_runs")
    data = _mixed_data(folder)
    common = {
        "data.source": str(data), "data.shuffle": False, "data.packing": "cat", "data.seq_len": 128,
        "data.pack_len": 128, "train.max_steps": 2,
    }  # fmt: skip
    lora = {"model.lora.r": 4, "model.lora.alpha": 8, "model.vlm.freeze_vision": True}
    layouts = {  # name: processes, cp_size, other settings
        "1": (1, 1, {}),
        "cp2": (2, 2, {"model.activation_checkpointing": True}),  # recomputes the all-to-alls in backward
        "dp2": (2, 1, lora),
        "dp2cp2": (4, 2, lora),
    }
    runs = {
        name: Background(tiny_run_args(folder / name, **common, **extra, **{"train.cp_size": cp}), nproc=nproc)
        for name, (nproc, cp, extra) in layouts.items()
    }
    for run in runs.values():
        run.wait(timeout=300)  # a hang (mismatched collectives) fails here instead of stalling the suite
    return {name: folder / name / "run" for name in layouts}


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "model.safetensors")


@pytest.mark.parametrize(("cp", "reference"), [("cp2", "1"), ("dp2cp2", "dp2")])
def test_training_with_cp2_equals_training_without(cp_runs, cp, reference):
    """Same losses, token counts, images and sample accounting every step, parameters within 1e-5 after 2 steps
    (full fine-tuning with a trainable tower and activation checkpointing; LoRA for the 2 x 2 pair, the merged
    ``final/`` compared); in the 2 x 2 run one CP group's row is text only in step 1, the other's has an image."""
    a, b = read_metrics(cp_runs[cp]), read_metrics(cp_runs[reference])
    steps_a, steps_b = ([r for r in m if "loss" in r] for m in (a, b))
    assert [r["step"] for r in steps_a] == [1, 2] == [r["step"] for r in steps_b]
    for ra, rb in zip(steps_a, steps_b, strict=True):
        for key in ("trainable_tokens", "real_tokens", "images", "samples_seen", "samples_packed"):
            assert ra[key] == rb[key], key
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
    wa, wb = _final_weights(cp_runs[cp]), _final_weights(cp_runs[reference])
    assert wa.keys() == wb.keys()
    # AdamW's first updates are lr * g / (|g| + eps): where a gradient element is near eps (1e-8), float32 noise in
    # it (the ranks sum in another order) moves the weight by up to a fraction of lr (measured: 2 of 718,536
    # weights, by 2.2e-5). Every other weight is within 1e-5; packs or a loss scale that differ move most weights.
    beyond = sum(int(((wa[k] - wb[k]).abs() > 1e-5).sum()) for k in wa)
    assert beyond <= 1e-5 * sum(v.numel() for v in wa.values()), beyond
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 2e-4  # lr / 5, as test_train.py


def test_real_head_shapes_allow_the_cp_sizes_the_readme_lists():
    """Qwen3.5-0.8B (8 query / 2 kv heads, GatedDeltaNet 16 / 16) runs cp 2, 4 and 8, its kv heads repeated at 4
    and 8; 4 kv heads (the 9B's) cannot split over 6 ranks."""
    text = qwen3_5_0_8b_config().text_config
    for size in (2, 4, 8):
        check_heads(text, size)
    with pytest.raises(ValueError, match="does not divide"):
        check_heads(text, 16)
    with pytest.raises(ValueError, match=r"4 key/value heads cannot be split over train\.cp_size = 6"):
        kv_heads_layout(4, 6)
