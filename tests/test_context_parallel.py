"""Context parallelism (Ulysses) on CPU over gloo: one packed row split over 2 ranks gives the logits, loss and every
gradient of the whole row on one rank; the vision work is split; head counts that cannot split are refused."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import launch_env

from vlm_sft.config import REPO_ROOT
from vlm_sft.model import build_model, tiny_qwen3_5_config
from vlm_sft.model.context_parallel import ContextParallel, kv_heads_layout, split_images

WORKER = str(Path(__file__).resolve().parent / "cp_worker.py")


@pytest.fixture(scope="module", params=["dense", "moe"])
def cp_results(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"cp_{request.param}")
    env = launch_env() | {"CP_OUT": str(out), "CP_MODEL": request.param}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER]
    done = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


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
        model.set_context_parallel(ContextParallel(None, 0, 4))
    model.set_context_parallel(ContextParallel(None, 0, 2))
    assert model.context_parallel.size == 2
