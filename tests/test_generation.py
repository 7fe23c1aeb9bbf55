"""Generated answers in eval: what the trainer's greedy replies (``trainer.generation``, on the decode cache) say
equals what transformers' ``generate`` says on the exported checkpoint, on 2 ranks as on 1, dense, MoE and LoRA.

Four short real runs side by side (the cores are shared; each trains 24 steps of the shapes task, enough for the
replies' template to be learned, so replies are real sentences, not noise: every run's 12 are at step 24, while at
step 12 MoE and LoRA still babble), then ``python -m vlm_sft.generate`` on their ``final/`` (its ``main``, in this
process): the tool a user serves the checkpoint with, transformers' model and the checkpoint's own template.

``VLM_SFT_LEARNING_CHECKS=1`` also runs the default run as the README starts it and asks its ``final/`` the held-out
colour questions through transformers, with the template's default and with ``enable_thinking=False``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import LEARNING_CHECK, Background, launch_env, read_metrics, tiny_run_args

from vlm_sft.config import REPO_ROOT
from vlm_sft.data.shapes import materialize_shapes

STEPS = 24
RUN = {
    "data.shapes.num_train": 400,
    "data.shapes.num_eval": 24,
    "data.seq_len": 256,
    "data.pack_len": 640,
    "train.max_steps": STEPS,
    "train.warmup_steps": 5,
    "train.eval_every": STEPS // 2,
    "train.eval_generate": 12,
    "train.eval_generate_max_tokens": 16,
    "model.initializer_range": 0.08,
    "data.metric": "exact_match",  # the held-out source is scored too (eval_score/eval, trainer.scored_eval)
    "data.max_scored": 6,
}


def _samples(run: Path, step: int, *, scored: bool = False) -> dict[int, dict]:
    """The eval's generated replies at ``step`` (``scored``: the scored source's rows instead), by row."""
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    return {r["index"]: r for r in rows if r["step"] == step and ("score" in r) == scored}


def _generate_cli(*args: str) -> str:
    """``python -m vlm_sft.generate ARGS``: its ``main`` in this process (the imports are paid once, ~5 s a launch),
    on one thread as the launched tool computes (``OMP_NUM_THREADS=1``); what it printed."""
    from vlm_sft.generate import main

    threads, printed = torch.get_num_threads(), io.StringIO()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(printed):
            assert main(list(args)) == 0
    finally:
        torch.set_num_threads(threads)
    return printed.getvalue()


def _transformers_replies(final: Path, data: Path, out: Path, *extra: str) -> dict[int, dict]:
    """``python -m vlm_sft.generate`` on ``final`` over the held-out file (rows in file order)."""
    _generate_cli(str(final), "--data", str(data), "--max-new-tokens", "16", "--out", str(out), *extra)
    return {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """dense (1 process x 2 micro-batches), dense_2ranks (2 processes x 1: the same global batch), dense_cp2 (2
    processes splitting each row, x 2 micro-batches: the same global batch again), moe, lora."""
    root = tmp_path_factory.mktemp("generation")
    shapes = {"data.shapes.root": str(root / "shapes")}
    plans = {
        "dense": ({"train.micro_batches": 2, "train.plot": True}, 1),
        "dense_2ranks": ({"train.micro_batches": 1}, 2),
        "dense_cp2": ({"train.micro_batches": 2, "train.cp_size": 2}, 2),
        "moe": ({"model.name_or_path": "tiny-moe", "train.micro_batches": 2}, 1),
        "lora": ({"train.micro_batches": 2, "model.lora.r": 8, "model.vlm.freeze_vision": True, "train.lr": 4e-3}, 1),
    }
    # The shapes set is written once, here, before the runs start (side by side they would race to write it).
    materialize_shapes(root / "shapes", num_train=RUN["data.shapes.num_train"], num_eval=RUN["data.shapes.num_eval"])
    started = {
        name: Background(tiny_run_args(root / name, **{**RUN, **shapes, **overrides}), nproc=nproc)
        for name, (overrides, nproc) in plans.items()
    }
    for run in started.values():
        run.wait(timeout=400)
    return {name: root / name / "run" for name in plans}


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_generate_equals_transformers_token_for_token_on_a_random_model(
    family, processor, renderer, image_files, tmp_path
):
    """``trainer.generation.generate`` (the decode cache, packed prefill of several prompts) against transformers'
    ``generate`` on the same weights saved as an HF checkpoint: 24 greedy tokens per prompt, no stop token. On an
    untrained model the continuation is sensitive to every part of decoding (a decode position off by one, a state
    not carried), which the short learned replies of the tests above are not."""
    from transformers import AutoModelForImageTextToText

    from processors import save_processor
    from vlm_sft.checkpoint.export import SINGLE_PROCESS, save_pretrained
    from vlm_sft.model import build_model, tiny_qwen3_5_config, tiny_qwen3_5_moe_config
    from vlm_sft.trainer.generation import generate

    make = tiny_qwen3_5_config if family == "dense" else tiny_qwen3_5_moe_config
    ours = build_model(make(initializer_range=0.08)).eval()
    save_processor(save_pretrained(ours, tmp_path), processor, processor.tokenizer)
    theirs = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    conversations = [
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": image_files[0]}, {"type": "text", "text": "Colour?"}],
            }
        ],
        [{"role": "user", "content": "What is 2 + 3?"}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    *({"type": "image", "image": p} for p in image_files[1:3]),
                ],
            }
        ],
    ]
    prompts = [renderer.render_prompt(c) for c in conversations]
    replies = generate(ours, prompts, SINGLE_PROCESS, max_new_tokens=24, stop_ids=[], token_budget=4096)
    for conversation, prompt, reply in zip(conversations, prompts, replies, strict=True):
        inputs = processor.apply_chat_template(
            conversation, add_generation_prompt=True, enable_thinking=False, tokenize=True, return_dict=True,
            return_tensors="pt",
        )  # fmt: skip
        assert torch.equal(inputs["input_ids"][0], prompt.token_ids)
        with torch.no_grad():
            out = theirs.generate(**inputs, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert out[0, inputs["input_ids"].shape[1] :].tolist() == reply


def test_held_out_rows_that_do_not_load_or_render_are_counted_not_fatal(renderer, image_files, caplog):
    """A malformed held-out line (the loader raises), a row without a reply and a missing image are left out of the
    generation prompts with one warning naming the reasons; the good row is kept."""
    from renderers import RenderError
    from vlm_sft.data.sources import Conversation
    from vlm_sft.trainer.generation import select_prompts

    good = [{"role": "user", "content": [{"type": "image", "image": image_files[0]}, {"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Red."}]  # fmt: skip
    rows = {
        0: Conversation(good, None, 0),
        2: Conversation([{"role": "user", "content": "No reply"}], None, 2),
        3: Conversation([{**good[0], "content": [{"type": "image", "image": "/missing.png"}]}, good[1]], None, 3),
    }

    class Source(list):
        def __getitem__(self, index):
            if index == 1:
                raise RenderError("malformed_row", "eval.jsonl:2: not valid JSON")
            return rows[index]

    prompts = select_prompts(Source(range(4)), {}, 4, 0, renderer)
    assert [(p.index, p.reference, p.images) for p in prompts] == [(0, "Red.", ("shape0.png",))]
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "3 of 4" in warning and "malformed_row" in warning and "no_assistant_turn" in warning


def _held_out(run: Path) -> Path:
    config = json.loads((run / "config.json").read_text())
    shapes = config["data"]["shapes"]
    return Path(shapes["root"]) / f"seed{shapes['seed']}-size{shapes['image_size']}" / "eval.jsonl"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense", "moe", "lora"])
def test_eval_replies_equal_transformers_generate_on_the_export(runs, name, tmp_path):
    """The replies the trainer logged at its last eval, from its own model and decode cache, are the replies
    transformers' ``generate`` gives on ``final/`` (LoRA: the merged export) with the saved template's default
    prompt: same text, same number of tokens. And they are learned sentences, not noise."""
    run = runs[name]
    ours = _samples(run, STEPS)
    assert len(ours) == RUN["train.eval_generate"]
    theirs = _transformers_replies(run / "final", _held_out(run), tmp_path / "replies.jsonl")
    for index, row in ours.items():
        assert row["reply"] == theirs[index]["reply"], (index, row["prompt"])
    if name == "dense":  # the saved template's default prompt is the non-thinking one the run trained
        explicit = _transformers_replies(
            run / "final", _held_out(run), tmp_path / "explicit.jsonl", "--enable-thinking", "false"
        )
        assert [r["reply"] for r in explicit.values()] == [r["reply"] for r in theirs.values()]
    sentences = [r["reply"] for r in ours.values() if r["reply"].endswith(".") and len(r["reply"].split()) >= 3]
    assert len(sentences) >= len(ours) // 2, [r["reply"] for r in ours.values()]
    assert [r["reply_tokens"] for r in ours.values()] and all(0 < r["reply_tokens"] <= 16 for r in ours.values())


@pytest.mark.slow
def test_one_question_about_an_image_from_the_command_line(runs):
    """The README's ``--image`` / ``--prompt`` form: the reply is the one the trainer's eval gave for that picture."""
    run = runs["dense"]
    ours = next(
        r
        for r in _samples(run, STEPS).values()
        if r["prompt"].startswith("<|im_start|>user\n<|vision_start|>")  # no system prompt, the image first
        and len(r["images"]) == 1
    )
    image = _held_out(run).parent / "images" / ours["images"][0]
    question = ours["prompt"].split("<|vision_end|>")[1].split("<|im_end|>")[0]
    printed = _generate_cli(str(run / "final"), "--image", str(image), "--prompt", question, "--max-new-tokens", "16")
    assert f"0: {ours['reply']!r}" in printed, (printed, ours)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense_2ranks", "dense_cp2"])
def test_two_ranks_generate_what_one_rank_generates(runs, name):
    """The same global batch on 2 processes trains the same model; its eval deals the prompts to both ranks (in
    step: one rank finishes first and keeps decoding fillers) and writes the same replies and accuracies. Under
    context parallelism the eval runs whole prompts per rank with CP switched off, as the teacher-forced eval does."""
    one, two = runs["dense"], runs[name]
    for step in (STEPS // 2, STEPS):
        a, b = _samples(one, step), _samples(two, step)
        assert a.keys() == b.keys()
        assert [a[i]["reply"] for i in a] == [b[i]["reply"] for i in a]

    def generated(run: Path) -> list[dict]:
        return [
            {k: v for k, v in r.items() if k.startswith("eval_gen_acc")} for r in read_metrics(run) if "eval_loss" in r
        ]

    assert generated(one) == generated(two) and generated(one)[-1]
    scored_one, scored_two = _samples(one, STEPS, scored=True), _samples(two, STEPS, scored=True)
    assert len(scored_one) == RUN["data.max_scored"]
    assert [r["prediction"] for r in scored_one.values()] == [r["prediction"] for r in scored_two.values()]
    assert [r["eval_score/eval"] for r in read_metrics(one) if "eval_loss" in r] == [
        r["eval_score/eval"] for r in read_metrics(two) if "eval_loss" in r
    ]


@pytest.mark.slow
def test_generated_accuracy_is_logged_beside_the_teacher_forced_one(runs):
    run = runs["dense"]
    evals = [r for r in read_metrics(run) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [STEPS // 2, STEPS]
    for record in evals:
        tasks = {k.removeprefix("eval_acc_") for k in record if k.startswith("eval_acc_")}
        generated = {k.removeprefix("eval_gen_acc_") for k in record if k.startswith("eval_gen_acc_")}
        assert "all" in generated and generated <= tasks
        assert record["eval_gen_samples"] == RUN["train.eval_generate"]
        rows = _samples(run, record["step"]).values()
        assert record["eval_gen_acc_all"] == pytest.approx(sum(r["correct"] for r in rows) / len(rows))
    row = next(iter(_samples(run, STEPS).values()))
    assert row["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the saved template's default
    assert set(row) >= {"step", "prompt", "images", "reference", "reply", "correct", "task"}
    assert (run / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(os.environ.get(LEARNING_CHECK) != "1", reason=f"learning check: set {LEARNING_CHECK}=1 (~4 min)")
def test_default_run_answers_colours_when_served_either_way(tmp_path):
    """The default run (configs/debug.toml, as `accelerate launch vlm_sft/train.py` runs it), served through
    transformers with its saved template: >= 90% of held-out colour questions right with the template's default
    prompt and with enable_thinking=False (the default run measured 30 of 70 with the default before the fix), and
    its own samples.jsonl >= 90% right on colour at the end."""
    out = tmp_path / "debug"
    run = Background(["--train.output_dir", str(out)])
    run.wait(timeout=900)
    data = _held_out(out)
    tasks = [json.loads(line).get("task") for line in data.read_text().splitlines()]
    for extra in ((), ("--enable-thinking", "false")):
        replies = _transformers_replies(out / "final", data, tmp_path / "replies.jsonl", *extra)
        colour = [r["correct"] for i, r in replies.items() if tasks[i] == "colour"]
        assert len(colour) >= 50 and sum(colour) >= 0.9 * len(colour), (extra, sum(colour), len(colour))
    last = max(r["step"] for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines()))
    colour = [r["correct"] for r in _samples(out, last).values() if r["task"] == "colour"]
    assert colour and sum(colour) >= 0.9 * len(colour)


def _evaluate_cli(run: Path, out: Path, *extra: str, nproc: int = 1) -> tuple[dict, list[dict]]:
    """``python -m vlm_sft.evaluate`` on the run's ``final/`` over the run's own scored held-out source."""
    config = json.loads((run / "config.json").read_text())
    shapes = config["data"]["shapes"]
    overrides = {
        "data.shapes.root": shapes["root"], "data.shapes.num_train": shapes["num_train"],
        "data.shapes.num_eval": shapes["num_eval"], "data.metric": "exact_match",
        "data.max_scored": RUN["data.max_scored"], "data.pack_len": RUN["data.pack_len"],
        "train.eval_generate_max_tokens": RUN["train.eval_generate_max_tokens"],
    }  # fmt: skip
    args = [str(run / "final"), "--output-dir", str(out), *extra]
    args += [a for k, v in overrides.items() for a in (f"--{k}", str(v))]
    if nproc == 1:  # in this process: the imports are paid once
        from vlm_sft.evaluate import main

        assert main(args) == 0
    else:
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
             "vlm_sft.evaluate", *args],
            cwd=REPO_ROOT, env=launch_env(), check=True, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    scores = json.loads((out / "scores.json").read_text())
    return scores, [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_evaluate_cli_on_final_scores_what_the_last_eval_scored(runs, tmp_path):
    """``vlm_sft.evaluate`` on ``final/`` gives the last in-training eval's predictions and score: on our decode
    cache over 1 and 2 processes, and through transformers' ``generate`` (the reference backend)."""
    run = runs["dense"]
    logged = _samples(run, STEPS, scored=True)
    score = [r for r in read_metrics(run) if "eval_loss" in r][-1]["eval_score/eval"]
    for name, extra, nproc in (("ours", (), 1), ("transformers", ("--backend", "transformers"), 1), ("two", (), 2)):
        scores, rows = _evaluate_cli(run, tmp_path / name, *extra, nproc=nproc)
        assert [r["index"] for r in rows] == list(logged), name
        assert [r["prediction"] for r in rows] == [r["prediction"] for r in logged.values()], name
        assert scores["eval"]["score"] == pytest.approx(score) and scores["eval"]["count"] == len(logged), name
        assert scores["eval"]["settings"]["metric"] == "exact_match"
    assert any(r["score"] == 1.0 for r in rows), [r["prediction"] for r in rows]  # learned answers, not noise


@pytest.mark.slow
def test_the_readme_scores_a_chartqa_file_as_written(runs, tmp_path, monkeypatch):
    """The documented scoring TOML table (docs/serving.md) validates as a ``[[data.eval_sources]]`` table, and its
    ``--source`` command, as written, scores a file of ChartQA's published columns (image, query, label) on a run's
    ``final/``."""
    import re
    import shlex
    import shutil
    import tomllib

    import datasets
    from PIL import Image

    from vlm_sft.config import SourceConfig
    from vlm_sft.evaluate import main

    readme = (REPO_ROOT / "docs" / "serving.md").read_text()
    toml_block = next(b for b in re.findall(r"^```toml\n(.*?)^```", readme, re.M | re.S) if "metric =" in b)
    table = SourceConfig(**tomllib.loads(toml_block)["data"]["eval_sources"][0])
    assert table.metric == "relaxed_accuracy" and table.label == "chartqa"
    command = next(
        line for line in readme.splitlines() if line.startswith("python -m vlm_sft.evaluate") and "--source" in line
    )
    monkeypatch.chdir(tmp_path)
    shutil.copytree(runs["dense"] / "final", tmp_path / "outputs" / "debug" / "final")
    (tmp_path / "data").mkdir()
    for colour in ("red", "blue"):
        Image.new("RGB", (64, 64), colour).save(tmp_path / f"{colour}.png")
    features = datasets.Features(
        {"image": datasets.Image(), "query": datasets.Value("string"), "label": datasets.List(datasets.Value("string"))}
    )
    images = [{"bytes": (tmp_path / f"{c}.png").read_bytes(), "path": None} for c in ("red", "blue")]
    rows = {"image": images, "query": ["Colour?", "Count?"], "label": [["Red."], ["3"]]}
    datasets.Dataset.from_dict(rows, features=features).to_parquet(tmp_path / "data" / "chartqa.parquet")
    argv = shlex.split(command)
    assert main(argv[3:]) == 0
    scores = json.loads((tmp_path / "outputs" / "debug" / "final" / "eval" / "scores.json").read_text())
    assert scores["chartqa"]["metric"] == "relaxed_accuracy" and scores["chartqa"]["count"] == 2
    predictions = (tmp_path / "outputs" / "debug" / "final" / "eval" / "predictions.jsonl").read_text().splitlines()
    assert all(
        "Answer the question using a single word or phrase.<|im_end|>" in json.loads(p)["prompt"] for p in predictions
    )
