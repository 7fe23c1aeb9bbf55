"""A weighted mixture (``[[data.sources]]``) keeps the trainer's data order guarantee: the packs of a step depend on
the global batch only. Three sources of three kinds (the generated shapes set, a prepared text-only jsonl and a
streamed jsonl) mixed 6 / 3 / 1:

- 2 processes x 1 micro-batch, SIGKILLed (launcher and workers) after their step-2 checkpoint, logged the steps of
  1 process x 2 micro-batches, and 1 process x 2 micro-batches resumed from that checkpoint continues exactly: loss,
  grad norm, token and image counts, and every source's ``samples/<name>``; each finished run's
  ``data_accounting.json`` has a ``sources`` entry per source that adds up to the totals, the same in both.
- At the data level (``TrainPipelines`` -> ``TrainBatches``, as ``trainer.setup.setup`` builds them), 0 and 2 data
  workers yield the same batches; the control shows the comparison fails when the draw of a source depends on the
  worker, or on the seed.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from batch_helpers import batch_differences, rank0_batches
from torch.utils.data import get_worker_info
from train_helpers import Background, is_alive, read_metrics, run_training, tiny_run_args

from vlm_sft.config import DEFAULT_CONFIG, RunConfig, load_config
from vlm_sft.data import build as data_build
from vlm_sft.data import mixture as mixture_module

SOURCES = {"shapes": 6, "chat": 3, "notes": 1}
"""Source name -> weight, in config order (a source's name is its file's stem, ``shapes`` for the generated set)."""
CHAT_ROWS, NOTES_ROWS, LONG_CHAT_ROWS = 40, 30, tuple(range(1, 40, 4))
"""Rows of the prepared and the streamed jsonl; the chat rows too long for ``data.seq_len`` (skipped: counted per
source)."""
WORDS = ("red", "blue", "green", "square", "circle", "left", "right", "above", "below", "one", "two", "small", "large")

COMMON = {
    "data.shapes.num_train": 48,
    "data.bfd_buffer": 16,  # a streamed source never ends an epoch: a small buffer yields the first packs soon
    "train.max_steps": 4,
    "train.warmup_steps": 1,
}
COUNT_KEYS = ("step", "real_tokens", "trainable_tokens", "images", "samples_seen", "samples_packed", "samples_skipped")
"""Metrics that must repeat exactly, with every ``samples/<name>``."""


def _turns(rng: random.Random, row: int, long: bool) -> list[dict]:
    """User / assistant turns of varying length (1 or 2 exchanges); ``long``: a reply far over ``data.seq_len``."""
    messages = []
    for turn in range(rng.randint(1, 2)):
        question = " ".join(rng.choices(WORDS, k=rng.randint(2, 14)))
        answer = " ".join(rng.choices(WORDS, k=300 if long and turn == 0 else rng.randint(1, 12)))
        messages += [{"role": "user", "content": f"row {row}: {question}?"}, {"role": "assistant", "content": answer}]
    return messages


def _write_jsonl(path: Path, rows: int, seed: int, long_rows: tuple[int, ...] = ()) -> None:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"messages": _turns(rng, i, i in long_rows)}) for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> tuple[Path, Path]:
    """``(config file, shapes root)``: configs/debug.toml with three ``[[data.sources]]`` tables instead of
    ``data.source``; the shapes set is written here once, so that concurrent runs only read it."""
    tmp = tmp_path_factory.mktemp("mixture")
    _write_jsonl(tmp / "chat" / "chat.jsonl", CHAT_ROWS, seed=1, long_rows=LONG_CHAT_ROWS)
    _write_jsonl(tmp / "notes" / "notes.jsonl", NOTES_ROWS, seed=2)
    text, replaced = re.subn(r'^source = "shapes"\n', "", DEFAULT_CONFIG.read_text(), flags=re.MULTILINE)
    assert replaced == 1, "configs/debug.toml no longer sets data.source = 'shapes' on a line of its own"
    tables = [
        ("shapes", {"source": "shapes", "weight": SOURCES["shapes"]}),
        ("chat", {"source": str(tmp / "chat" / "chat.jsonl"), "weight": SOURCES["chat"]}),
        ("notes", {"source": str(tmp / "notes" / "notes.jsonl"), "weight": SOURCES["notes"], "streaming": True}),
    ]
    for _, table in tables:
        text += "\n[[data.sources]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items())
    config = tmp / "mixture.toml"
    config.write_text(text)
    shapes_root = tmp / "shapes"
    cfg = load_config(config, tiny_run_args(tmp, **COMMON, **{"data.shapes.root": str(shapes_root)}))
    assert [(s.label, s.weight, bool(s.streaming)) for s in cfg.data.sources] == [
        (name, SOURCES[name], name == "notes") for name, _ in tables
    ]
    data_build.materialize_data(cfg, progress=False)
    return config, shapes_root


def _args(tmp: Path, mixture: tuple[Path, Path], **extra: object) -> list[str]:
    config, shapes_root = mixture
    return ["--config", str(config), *tiny_run_args(tmp, **COMMON, **{"data.shapes.root": str(shapes_root)}, **extra)]


# -- training: 2 processes killed and resumed on 1 ---------------------------------------------------------------


def _counts(record: dict) -> dict:
    return {k: v for k, v in record.items() if k in COUNT_KEYS or k.startswith("samples/")}


def _assert_same_steps(got: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for a, b in zip(got, expected, strict=True):
        assert _counts(a) == _counts(b)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), a["step"]
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12), a["step"]


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "loss" in r]


def _check_sources(run_dir: Path) -> dict:
    """The final ``data_accounting.json``: one ``sources`` entry per source, adding up to the totals."""
    record = json.loads((run_dir / "data_accounting.json").read_text())
    sources = record["sources"]
    assert list(sources) == list(SOURCES)
    totals = {"seen": "samples_seen", "packed": "samples_packed", "samples_skipped": "samples_skipped"}
    for key, total in totals.items():
        assert sum(s[key] for s in sources.values()) == record[total], (key, record)
    for name, s in sources.items():
        assert s["seen"] == s["packed"] + s["samples_skipped"] + s["buffered"] and s["buffered"] >= 0, name
        assert s["samples_skipped"] == sum(r["count"] for r in s["skipped"].values()), name
    return record


def test_mixture_two_processes_killed_and_resumed_on_one_match_one_process(tmp_path, mixture):
    reference = Background(_args(tmp_path / "reference", mixture, **{"train.micro_batches": 2}))
    victim = Background(_args(tmp_path / "victim", mixture, **{"train.save_every": 2}), nproc=2)
    checkpoint = tmp_path / "victim" / "run" / "checkpoints" / "step-000002"
    workers = victim.kill_after(checkpoint)
    assert len(workers) == 2 and not any(is_alive(pid) for pid in workers), workers  # no worker trains on
    reference.wait(timeout=180)

    expected = _steps(tmp_path / "reference" / "run")
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    for r in expected:  # every source is drawn from the first step on, and the per-source counts add up
        drawn = [r[f"samples/{name}"] for name in SOURCES]
        assert sum(drawn) == r["samples_seen"] and min(drawn) > 0, r
    killed = _steps(tmp_path / "victim" / "run")
    assert len(killed) >= 2  # the kill came after the step-2 checkpoint; a step after it may be logged too
    assert not (tmp_path / "victim" / "run" / "final").exists()  # nothing of the victim trained on to the end
    _assert_same_steps(killed, expected[: len(killed)])

    resumed = tmp_path / "resumed"
    run_training(_args(resumed, mixture, **{"train.micro_batches": 2, "train.resume": str(checkpoint)}), timeout=180)
    _assert_same_steps(_steps(resumed / "run"), expected[2:])
    whole, again = _check_sources(tmp_path / "reference" / "run"), _check_sources(resumed / "run")
    assert again["sources"] == whole["sources"]  # the per-source counts were carried through the checkpoint
    assert whole["sources"]["chat"]["samples_skipped"] > 0  # the too-long chat rows: skips are counted per source


# -- data level: 0 and 2 workers ----------------------------------------------------------------------------------

BATCHES = 8
"""Micro-batches compared per run: two turns of each of the 4 streams."""
DATA_LAYOUT = {"data.streams_per_micro_batch": 2, "train.micro_batches": 2}
"""2 x 2 = 4 streams per rank, which 2 workers really share."""


_PARTS: dict[str, tuple] = {}


def _data_parts(cfg: RunConfig) -> tuple:
    """Processor, renderer and training sources of a config (built once per config: only the batches are compared)."""
    key = cfg.model_dump_json()
    if key not in _PARTS:
        processor = data_build.build_processor(cfg)
        _PARTS[key] = processor, data_build.build_renderer(cfg, processor), data_build.load_sources(cfg).train
    return _PARTS[key]


def _data_config(mixture: tuple[Path, Path], tmp: Path, **overrides: object) -> RunConfig:
    config, shapes_root = mixture
    args = tiny_run_args(tmp, **COMMON, **DATA_LAYOUT, **{"data.shapes.root": str(shapes_root)}, **overrides)
    return load_config(config, args)


def _batches(cfg: RunConfig, num_workers: int) -> list[dict]:
    """The first ``BATCHES`` micro-batches of rank 0 of one process, as ``trainer.setup.setup`` builds them."""
    processor, renderer, sources = _data_parts(cfg)
    assert isinstance(sources, data_build.MixedSources)
    return rank0_batches(cfg, processor, renderer, sources, num_workers=num_workers, count=BATCHES)


def test_mixture_batches_do_not_depend_on_workers(tmp_path, mixture, monkeypatch):
    cfg = _data_config(mixture, tmp_path)
    reference = _batches(cfg, 0)
    assert len(reference) == BATCHES and len({b["sample_indices"] for b in reference}) == BATCHES
    drawn = {i % len(SOURCES) for b in reference for pack in b["sample_indices"] for i in pack}
    assert drawn == set(range(len(SOURCES)))  # the packs mix all three sources (mixture index: row x S + source)
    assert batch_differences(_batches(cfg, 2), reference) == []

    # Control: the comparison sees a draw that depends on the seed, or on the worker that makes it.
    assert batch_differences(_batches(_data_config(mixture, tmp_path, **{"train.seed": 1}), 0), reference)
    block_seed = mixture_module._block_seed

    def per_worker_seed(seed: int, stream: int, block: int) -> int:
        info = get_worker_info()
        return block_seed(seed + (info.id if info is not None else 0), stream, block)

    monkeypatch.setattr(mixture_module, "_block_seed", per_worker_seed)
    assert batch_differences(_batches(cfg, 0), reference) == []  # the training process alone draws as before
    assert batch_differences(_batches(cfg, 2), reference)  # worker 1's streams draw other sources
