"""Every run accounts for its samples: the accounting arithmetic, a run over data with a few bad rows that finishes
and says what it skipped (log, metrics.jsonl, data_accounting.json), and a run over mostly broken data that stops
early with the skip report instead of training for hours on what is left."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from train_helpers import Background, read_metrics, tiny_run_args

from renderers.errors import RenderError
from vlm_sft.data.accounting import DataAccounting, SkipReport
from vlm_sft.data.shapes import materialize_shapes


def test_accounting_adds_up_over_shares_and_keeps_details():
    a, b = SkipReport(max_examples=2), SkipReport()
    for i in range(3):
        a.add(RenderError("missing_image", f"no such image file: img/{i}.png", sample_index=i))
    b.add(RenderError("malformed_row", "rows.jsonl:7: not valid JSON", sample_index=6))
    first = DataAccounting(seen=10, packed=6, skips=a, pass_ends=[[4, 3, 1], [8, 6, 2]])
    second = DataAccounting(seen=5, packed=3, skips=b, pass_ends=[[4, 3, 1]])
    total = DataAccounting.total([first, second])
    assert (total.seen, total.packed, total.skipped, total.buffered, total.passes) == (15, 9, 4, 2, 1)
    assert total.pass_counts(1) == {"seen": 8, "packed": 6, "skipped": 2}  # the pass both shares completed
    assert first.pass_counts(2) == {"seen": 4, "packed": 3, "skipped": 1}
    assert DataAccounting.from_dict(total.to_dict()).to_dict() == total.to_dict()
    text = total.format("data")
    assert "row 6: rows.jsonl:7: not valid JSON" in text and "row 1: no such image file: img/1.png" in text
    assert "img/2.png" not in text  # only max_examples examples per reason
    broken = DataAccounting(seen=3, packed=3, skips=b)
    with pytest.raises(AssertionError, match="does not balance"):
        broken.check()


def _data(tmp_path: Path, *, rows: int, bad_images: int) -> Path:
    """Shapes rows, the first ``bad_images`` with a corrupt png, plus a malformed line and a JSON array line."""
    shapes = materialize_shapes(tmp_path / "shapes", num_train=rows, num_eval=0, seed=1, image_size=64, progress=False)
    folder = shapes["train"].parent
    lines = shapes["train"].read_text().splitlines()
    broken = 0
    for i, line in enumerate(lines):
        row = json.loads(line)
        blocks = [b for m in row["messages"] if isinstance(m["content"], list) for b in m["content"]]
        image = next((b for b in blocks if b.get("type") == "image"), None)
        if image is None or broken == bad_images:
            continue
        (folder / f"broken{i}.png").write_bytes(b"not a png at all")
        image["image"] = f"broken{i}.png"
        lines[i] = json.dumps(row)
        broken += 1
    lines.insert(3, "{not json")
    lines.insert(9, "[1, 2, 3]")
    out = folder / "mixed.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Both runs at once (independent, one process each: they share the cores): ``few`` with 4 bad rows of 102,
    ``most`` with 320 corrupt images of 400."""
    started = {}
    for name, rows, bad, extra in (
        # 4 of 102 skipped: under the 5% limit; one data stream, so that 36 steps make a whole pass
        ("few", 100, 2, {"train.max_steps": 36, "data.bfd_buffer": 16, "data.streams_per_micro_batch": 1}),
        ("most", 400, 320, {"train.max_steps": 50, "data.shapes.num_train": 400}),
    ):
        tmp = tmp_path_factory.mktemp(name)
        args = tiny_run_args(tmp, **{"data.source": str(_data(tmp, rows=rows, bad_images=bad)), **extra})
        started[name] = (tmp, Background(args))
    try:
        return {name: (tmp, run.wait(180, check=False)) for name, (tmp, run) in started.items()}
    finally:
        for _, run in started.values():
            run.kill()  # the other run too, when one hung


def test_a_run_with_a_few_bad_rows_reports_them_everywhere(runs):
    tmp_path, proc = runs["few"]
    assert proc.returncode == 0, proc.stderr[-6000:]
    run = tmp_path / "run"
    acc = json.loads((run / "data_accounting.json").read_text())
    assert acc["samples_seen"] == acc["samples_packed"] + acc["samples_skipped"] + acc["samples_buffered"]
    assert acc["passes"] >= 1, "36 steps of 160-token packs cover the 102 rows"
    skipped = acc["skipped"]
    assert skipped["malformed_row"]["count"] >= 2 and skipped["corrupt_image"]["count"] >= 2
    details = [e["detail"] for e in skipped["malformed_row"]["examples"]]
    assert any("mixed.jsonl:4" in d for d in details) and any("mixed.jsonl:10" in d for d in details)
    first_pass = next(h["pass"] for h in acc["history"] if "pass" in h)
    assert first_pass["number"] == 1 and first_pass["seen"] == 102 == first_pass["packed"] + first_pass["skipped"]
    logged = proc.stdout + proc.stderr
    assert "skipped" in logged and "malformed_row" in logged and "mixed.jsonl:4" in logged
    last = [r for r in read_metrics(run) if "loss" in r][-1]
    assert last["samples_skipped"] >= 4 and last["samples_seen"] >= 102
    assert 0.0 <= last["data_wait_fraction"] <= 1.0 and last["data_wait_s"] >= 0.0


def test_a_run_over_mostly_broken_images_stops_early_with_the_report(runs):
    tmp_path, proc = runs["most"]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "data.max_skip_fraction" in proc.stderr and "corrupt_image" in proc.stderr
    assert re.search(r"row \d+: \S+/broken\d+\.png: not a readable image", proc.stderr)  # the report names the files
    seen = int(re.search(r"\d+ of the (\d+) samples seen so far", proc.stderr).group(1))
    assert seen <= 300, f"stopped only after {seen} samples"
    assert not (tmp_path / "run" / "final").exists()
