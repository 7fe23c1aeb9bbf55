"""``python -m vlm_sft.plot``: a run's metrics.jsonl drawn into one PNG, with or without evals and generated
accuracy, and a note (not a crash) where a series is missing."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from vlm_sft.config import REPO_ROOT
from vlm_sft.plot import PANELS, draw_run, final_numbers, plot_run, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(folder: Path, *, evals: bool, generated: bool) -> Path:
    """A 100-step run logged every 10 steps, with an eval every 50 (colour and shape tasks) when asked."""
    lines = []
    for step in range(10, 101, 10):
        lines.append(
            {"step": step, "loss": 5.0 * math.exp(-step / 30), "lr": 1e-3 * step / 100, "tokens_per_s": 900 + step}
        )
        if evals and step % 50 == 0:
            record = {"step": step, "eval_loss": 2.0 / step, "eval_tokens": 400}
            for task, acc in (("colour", step / 100), ("shape", 0.2), ("all", step / 200)):
                record[f"eval_acc_{task}"] = acc
                if generated:
                    record[f"eval_gen_acc_{task}"] = acc * 0.9
            lines.append(record)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data[:8] == PNG_SIGNATURE and len(data) > 30_000  # a blank 1300x850 canvas is far smaller


@pytest.mark.parametrize(
    ("evals", "generated", "accuracy"),
    [
        (True, True, {"eval_acc_all", "eval_gen_acc_all", "eval_acc_colour", "eval_gen_acc_colour"}),
        (True, False, {"eval_acc_all", "eval_acc_colour", "eval_acc_shape"}),
        (False, False, set()),
    ],
)
def test_plot_draws_what_the_run_logged(tmp_path, evals, generated, accuracy):
    # Fails when a logged series is left out (or one the run did not log is claimed), or a missing one crashes.
    run = _write_run(tmp_path / "run", evals=evals, generated=generated)
    out = plot_run(run)
    assert out == run / "run.png" and _is_png(out)
    _, drawn = draw_run(read_metrics(run / "metrics.jsonl"), "run")
    assert list(drawn) == list(PANELS)
    assert drawn["loss"] == (["loss", "eval_loss"] if evals else ["loss"])
    assert accuracy <= set(drawn["accuracy"])
    assert any(k.startswith("eval_gen_acc_") for k in drawn["accuracy"]) == generated
    assert drawn["learning rate"] == ["lr"] and drawn["tokens/s"] == ["tokens_per_s"]
    title = final_numbers(read_metrics(run / "metrics.jsonl"))
    assert title.startswith("step 100: loss 0.1784")
    assert ("eval loss 0.0200, acc 0.500 (colour 1.000)" in title) == evals
    assert ("generated acc 0.450 (colour 0.900)" in title) == generated


def test_empty_or_cut_metrics_still_give_a_plot(tmp_path):
    # The last line of a killed run can be cut mid-record; a run killed before its first log has no line at all.
    run = _write_run(tmp_path / "run", evals=True, generated=False)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 110, "loss": 0.1')
    assert len(read_metrics(run / "metrics.jsonl")) == 12
    assert _is_png(plot_run(run, tmp_path / "cut.png"))
    (run / "metrics.jsonl").write_text("")
    _, drawn = draw_run([], "empty")
    assert drawn == {panel: [] for panel in PANELS}
    assert (plot_run(run, tmp_path / "empty.png")).read_bytes()[:8] == PNG_SIGNATURE


def test_cli_writes_the_png_and_explains_a_missing_run(tmp_path):
    run = _write_run(tmp_path / "run", evals=True, generated=True)
    out = tmp_path / "plots" / "a.png"
    cli = [sys.executable, "-m", "vlm_sft.plot"]
    done = subprocess.run([*cli, str(run), "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out) and _is_png(out)
    helped = subprocess.run([*cli, "--help"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert helped.returncode == 0 and "--out" in helped.stdout and "run.png" in helped.stdout
    missing = subprocess.run([*cli, str(tmp_path / "nope")], cwd=REPO_ROOT, capture_output=True, text=True)
    assert missing.returncode == 2 and "metrics.jsonl does not exist" in missing.stderr
