"""The data report CLI: one pass over the data without a model, every sample accounted for, skips with reasons."""

from __future__ import annotations

import json

from PIL import Image

from vlm_sft.config import load_config
from vlm_sft.report import build_report, main


def test_report_on_shapes_accounts_for_every_sample(tmp_path):
    cfg = load_config(
        None,
        [
            "--data.shapes.root",
            str(tmp_path / "shapes"),
            "--data.shapes.num_train",
            "60",
            "--data.shapes.num_eval",
            "0",
        ],
    )
    report = build_report(cfg, progress=False)
    assert report["samples_seen"] == 60 == report["samples_packed"]
    assert report["skipped"] == {}
    assert report["real_tokens"] + report["padding_tokens"] == report["capacity_tokens"]
    assert 0.9 < report["packing_efficiency"] <= 1.0
    assert report["images"] > 0 and report["patches_per_pack"]["max"] >= report["patches_per_pack"]["min"] > 0
    stack = build_report(cfg, packing="stack", progress=False)
    assert stack["samples_packed"] == 60 and stack["packing_efficiency"] < report["packing_efficiency"]


def test_cli_writes_json_with_skip_reasons(tmp_path, capsys):
    Image.new("RGB", (64, 64), "red").save(tmp_path / "ok.png")
    ok = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": "ok.png"}, {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": "Red."},
        ]
    }
    missing = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": "nope.png"}]},
            {"role": "assistant", "content": "?"},
        ]
    }
    video = {
        "messages": [
            {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]},
            {"role": "assistant", "content": "?"},
        ]
    }
    no_answer = {"messages": [{"role": "user", "content": "Hello?"}]}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [ok, missing, ok, video, no_answer]))
    out = tmp_path / "report.json"
    assert main(["--data.source", str(data), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["samples_seen"] == 5 and report["samples_packed"] == 2
    missing_example = report["skipped"]["missing_image"]["examples"]
    assert report["skipped"]["missing_image"]["count"] == 1 and [e["row"] for e in missing_example] == [1]
    assert missing_example[0]["detail"].endswith("nope.png")  # which file: the detail, not only the reason key
    assert [e["row"] for e in report["skipped"]["missing_video"]["examples"]] == [3]
    assert [e["row"] for e in report["skipped"]["no_assistant_turn"]["examples"]] == [4]
    printed = capsys.readouterr().out
    assert "missing_image" in printed and "row 1: no such image file" in printed and "nope.png" in printed


def test_cli_rejects_a_bad_config(capsys):
    assert main(["--data.packing", "zigzag"]) == 2
    assert "data.packing" in capsys.readouterr().err
