"""The trainer end to end on CPU: FSDP2 over gloo, exact loss normalization, mixed modalities across ranks, exact
resume after a real SIGKILL, and a final checkpoint that transformers loads with the same logits."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from train_helpers import (
    Background,
    deterministic,
    launch_env,
    read_metrics,
    run_training,
    tiny_run_args,
)

from vlm_sft.config import REPO_ROOT


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted((run_dir / "final").glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory) -> tuple[Path, Path]:
    """Side by side (independent runs share the cores), 2 steps each: 1 process with 2 data workers x 4 micro-batches
    per step and a held-out eval at the end; 2 processes x 2 micro-batches with one held-out sample."""
    one, two = tmp_path_factory.mktemp("one_rank"), tmp_path_factory.mktemp("two_ranks")
    two_ranks = Background(tiny_run_args(two, **{"train.micro_batches": 2, "data.shapes.num_eval": 1}), nproc=2)
    run_training(tiny_run_args(one, **{"train.micro_batches": 4, "data.shapes.num_eval": 8, "data.num_workers": 2}))
    two_ranks.wait()
    return one / "run", two / "run"


@pytest.fixture(scope="module")
def one_rank_run(rank_runs) -> Path:
    return rank_runs[0]


def test_two_ranks_equal_one_rank_with_more_micro_batches(rank_runs):
    """2 ranks x 2 micro-batches see the same packs per step as 1 rank x 4: same losses and parameters.

    The packs of a step depend on the global batch only (4 here), never on the ranks or the data workers: the 1-rank
    run packs in 2 workers, the ranks here in the training process.

    The 2-rank run has one held-out sample, so rank 1's share of eval packs is empty: it must still take part in
    eval (FSDP gathers parameters in every forward) instead of leaving rank 0 waiting."""
    one_rank_run, two_rank_run = rank_runs
    one, two = read_metrics(one_rank_run), read_metrics(two_rank_run)
    assert [r["eval_tokens"] for r in two if "eval_loss" in r][-1] > 0
    a, b = deterministic(one), deterministic(two)
    assert [r["step"] for r in a] == [1, 2] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra["trainable_tokens"] == rb["trainable_tokens"] and ra["real_tokens"] == rb["real_tokens"]
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5, abs=1e-6)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
    wa, wb = _weights(one_rank_run), _weights(two_rank_run)
    assert wa.keys() == wb.keys()
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    # The ranks sum the micro-batch gradients in another order (fp32 noise ~1e-7 relative). AdamW's first steps move
    # every weight by about lr * g / (|g| + eps), so that noise reaches the weights only where |g| is near eps
    # (1e-8; seen in the GatedDeltaNet decay gate). A bound of lr / 5 still fails when the packs differ, which moves
    # most weights by up to lr; a wrong loss scale, to which AdamW is blind, fails the grad_norm check above.
    assert worst <= 2e-4, worst
    assert all(torch.isfinite(t).all() for t in wa.values())


def test_eval_reports_loss_and_accuracy(one_rank_run):
    evals = [r for r in read_metrics(one_rank_run) if "eval_loss" in r]
    assert evals and evals[-1]["step"] == 2
    assert 0.0 < evals[-1]["eval_loss"] < 20
    assert 0.0 <= evals[-1]["eval_acc_all"] <= 1.0


def test_final_checkpoint_loads_in_transformers_with_same_logits(one_rank_run):
    from transformers import Qwen3_5ForConditionalGeneration

    from processors import load_processor
    from vlm_sft.checkpoint.load import from_pretrained
    from vlm_sft.data.mrope import batch_position_ids

    final = one_rank_run / "final"
    processor = load_processor(final)
    image = Image.new("RGB", (64, 64), (200, 30, 30))
    messages = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What colour?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "The shape is red."}]},
    ]
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    theirs = Qwen3_5ForConditionalGeneration.from_pretrained(final, dtype=torch.float32).eval()
    ours = from_pretrained(final).eval()
    with torch.no_grad():
        ref = theirs(
            input_ids=inputs["input_ids"],
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
        ).logits
        got = ours(
            inputs["input_ids"],
            position_ids=batch_position_ids(inputs["mm_token_type_ids"], inputs["image_grid_thw"]),
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
        )
    assert float((ref - got).abs().max()) <= 1e-4
    saved_cfg = json.loads((final / "config.json").read_text())
    assert saved_cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]


def _write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _image_row(folder: Path, name: str, n_images: int) -> dict:
    blocks = []
    for k in range(n_images):
        p = folder / f"{name}-{k}.png"
        Image.new("RGB", (64, 64), (40 * k + 30, 120, 200)).save(p)
        blocks.append({"type": "image", "image": p.name})
    filler = " ".join(["please describe the picture carefully"] * 6)
    return {
        "messages": [
            {"role": "user", "content": [*blocks, {"type": "text", "text": filler}]},
            {"role": "assistant", "content": [{"type": "text", "text": "It is a picture with colours."}]},
        ]
    }


def _text_row() -> dict:
    filler = " ".join(["tell me something about shapes and colours"] * 6)
    return {"messages": [{"role": "user", "content": filler}, {"role": "assistant", "content": "Shapes have colours."}]}


MOE = {"model.name_or_path": "tiny-moe", "model.router_aux_loss_coef": 0.05}
"""The MoE preset with the load-balancing loss on: each step also sums the routers' counts over the ranks."""


@pytest.mark.parametrize("model", [{}, MOE], ids=["dense", "moe"])
def test_mixed_modalities_across_ranks_finish(tmp_path, model):
    """Rank 0 and rank 1 get micro-batches with different image counts: none at all on rank 0 in steps 1-2 (text
    only vs one image), two vs one in steps 3-4. The vision tower still runs in step on both, so FSDP's collectives
    match and the run finishes instead of hanging (for the MoE model too, whose ranks route different tokens)."""
    images = [(0, 1), (0, 1), (2, 1), (2, 1)]  # (rank 0, rank 1) per step
    rows = []
    for step, pair in enumerate(images):
        for rank, n in enumerate(pair):  # unshuffled, one row per pack: global micro-batch i is stream i's row i
            rows.append(_image_row(tmp_path, f"s{step}r{rank}", n) if n else _text_row())
    data = tmp_path / "mixed.jsonl"
    _write_rows(data, rows)
    args = tiny_run_args(
        tmp_path,
        **{
            "data.source": str(data),
            "data.shuffle": False,
            "data.packing": "cat",
            "data.seq_len": 128,
            "data.pack_len": 128,
            "train.max_steps": len(images),
            **model,
        },
    )
    run_training(args, nproc=2, timeout=120)
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["images"] for r in records] == [sum(pair) for pair in images]


def test_resume_after_sigkill_equals_uninterrupted(tmp_path):
    common = {
        "train.max_steps": 12,
        "train.save_every": 3,
        "train.warmup_steps": 2,
        "data.shapes.num_train": 96,
        "data.num_workers": 2,
        "data.shapes.num_eval": 6,
        "train.eval_every": 3,
        "train.eval_generate": 6,
        "train.eval_generate_max_tokens": 4,
    }
    reference = tmp_path / "ref"
    uninterrupted = Background(tiny_run_args(reference, **common))  # beside the victim: independent runs

    victim = tmp_path / "victim"
    # The interrupted run prefetches batches in 2 worker processes: its checkpoints must still hold the state of
    # the last batch consumed from each, and which worker is next, so both runs see the same stream.
    args = tiny_run_args(victim, **common)
    Background(args).kill_after(victim / "run" / "checkpoints" / "step-000003")
    uninterrupted.wait()
    expected = deterministic(read_metrics(reference / "run"))
    run_training([*args, "--train.resume", "latest"])
    got = deterministic(read_metrics(victim / "run"))
    assert got == expected
    # The generated eval replies too: samples.jsonl keeps what was written up to the checkpoint, then continues.
    samples = [(r / "run" / "samples.jsonl").read_text().splitlines() for r in (reference, victim)]
    assert samples[0] == samples[1] and len(samples[0]) == 6 * 4
    latest = sorted((victim / "run" / "checkpoints").glob("step-*"))[-1]
    assert (latest / "hf" / "config.json").is_file() and (latest / "hf" / "tokenizer.json").is_file()


def test_kill_during_checkpoint_write_keeps_previous(tmp_path):
    """A process SIGKILLed in the middle of writing a checkpoint leaves the previous one loadable."""
    script = f"""
import os, signal, torch
import torch.distributed.checkpoint as dcp
from vlm_sft.checkpoint import state as ck
from vlm_sft.parallel.env import DistEnv
env = DistEnv(0, 1, 0, torch.device("cpu"))
model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
model(torch.ones(1, 4)).sum().backward(); opt.step()
state = ck.TrainerState(step=1, scheduler={{}}, data={{"pos": 1}}, rng=ck.capture_rng())
ck.save_checkpoint({str(tmp_path)!r}, model=model, optimizer=opt, state=state, env=env, keep_last=2)
real_save = dcp.save
def dying_save(*args, **kwargs):
    real_save(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)  # after the shards, before the trainer state and the rename
dcp.save = dying_save  # parallel.dcp.save_tensors calls it through the module
state.step = 2
ck.save_checkpoint({str(tmp_path)!r}, model=model, optimizer=opt, state=state, env=env, keep_last=2)
"""
    proc = subprocess.run([sys.executable, "-c", script], env=launch_env(), cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / "checkpoints" / "step-000002.tmp").is_dir()
    from vlm_sft.checkpoint.state import load_checkpoint, resolve_resume
    from vlm_sft.parallel.env import DistEnv

    latest = resolve_resume("latest", tmp_path)
    assert latest.name == "step-000001"
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    state = load_checkpoint(latest, model=model, optimizer=opt, env=DistEnv(0, 1, 0, torch.device("cpu")))
    assert state.step == 1 and state.data == {"pos": 1}


def test_bf16_without_cuda_is_refused_with_the_fix(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from vlm_sft.train import main

    args = tiny_run_args(tmp_path, **{"model.dtype": "bfloat16", "train.device": "auto"})
    assert main(args) == 2
    assert "set model.dtype = 'float32'" in capsys.readouterr().err


def test_a_resume_reads_the_trainer_state_and_builds_the_pipelines_once(tmp_path, monkeypatch):
    """``setup`` reads a resumed checkpoint's trainer state (JSON, the RNG file, every rank's data position, with
    collectives on several ranks) once, before the model is built, and builds the data pipelines once; it did both
    twice (the data check, then the DCP load and the batches). The resumed run still continues from step 1."""
    from vlm_sft.checkpoint import state
    from vlm_sft.data import build as data_build
    from vlm_sft.train import main

    args = tiny_run_args(tmp_path, **{"train.max_steps": 2, "train.save_every": 1})
    assert main(args) == 0  # checkpoints after step 1 (the last step writes final/ only)
    reads, built = [], []
    read, pipelines = state._read, data_build.TrainPipelines
    monkeypatch.setattr(state, "_read", lambda path, env: reads.append(path) or read(path, env))
    monkeypatch.setattr(data_build, "TrainPipelines", lambda *a, **k: built.append(a) or pipelines(*a, **k))
    assert main([*args, "--train.max_steps", "3", "--train.resume", "latest"]) == 0
    assert [p.name for p in reads] == ["step-000001"] and len(built) == 1
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2, 3]
