"""Experiment trackers (``train.report_to``, ``trainer.trackers``): real TensorBoard event files read back against
metrics.jsonl, a SIGKILLed run resumed into the same TensorBoard run, and the W&B / MLflow / trackio wiring against
fake accelerate trackers (none of the three is installed here)."""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
from pydantic import ValidationError
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from train_helpers import Background, read_metrics, run_training, tiny_run_args

from vlm_sft.config import ConfigError, TrainConfig
from vlm_sft.trainer import trackers
from vlm_sft.trainer.metrics import MetricsLogger

TB = {"train.report_to": ["tensorboard"]}


def _events(folder: Path) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def _scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in _events(folder).Scalars(tag)]


# ------------------------------------------------------------------------------------------ real training runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Side by side: a run with evals, and a victim SIGKILLed right after its step-4 checkpoint, whose step-4
    checkpoint is then deleted: the killed run has logged steps 3 and 4 past the checkpoint (step 2) it resumes from,
    which a kill right after the step-2 checkpoint would almost never leave (the next log is a training step away)."""
    plain, victim = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("victim")
    evals = Background(
        tiny_run_args(plain, **TB, **{"train.max_steps": 4, "data.shapes.num_eval": 12, "train.eval_every": 2})
    )
    args = tiny_run_args(victim, **TB, **{"train.max_steps": 6, "train.save_every": 2})
    checkpoints = victim / "run" / "checkpoints"
    Background(args).kill_after(checkpoints / "step-000004")
    killed = _scalars(victim / "run" / "tensorboard", "loss")
    shutil.rmtree(checkpoints / "step-000004")
    run_training([*args, "--train.resume", "latest"])
    evals.wait()
    return {"plain": plain / "run", "victim": victim / "run", "killed_loss": killed}


def test_tensorboard_holds_every_number_of_metrics_jsonl(runs):
    # Fails when a record, a field (eval accuracy, lr, ...) or a step goes missing or lands at another step.
    run = runs["plain"]
    events = _events(run / "tensorboard")
    records = read_metrics(run)
    assert any("eval_acc_all" in r for r in records) and any("loss" in r for r in records)
    expected: dict[str, list[tuple[int, np.float32]]] = {}
    for r in records:
        for key, value in trackers.numeric_fields(r).items():
            expected.setdefault(key, []).append((r["step"], np.float32(value)))  # TensorBoard stores float32
    assert set(expected) <= set(events.Tags()["scalars"])
    for key, series in expected.items():
        assert [(e.step, e.value) for e in events.Scalars(key)] == series, key
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"train.report_to": "[\\"tensorboard\\"]"' in config


def test_resumed_run_continues_the_tensorboard_run_without_duplicate_steps(runs):
    # Without purge_step the killed run's steps 3 and 4 stay beside the resumed run's: each would appear twice.
    run = runs["victim"]
    assert [step for step, _ in runs["killed_loss"]] == [1, 2, 3, 4]  # the case the purge exists for
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one folder, a file per process
    losses = [(r["step"], np.float32(r["loss"])) for r in read_metrics(run) if "loss" in r]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 6]
    assert _scalars(run / "tensorboard", "loss") == losses


def test_checkpoints_hold_the_tracker_state(runs):
    # Fails when _save leaves the trackers out of trainer_state.json (a resume would start new tracker runs).
    checkpoints = runs["victim"] / "checkpoints"
    for step in ("step-000002", "step-000004"):  # written by the killed run, then by the resumed one
        state = json.loads((checkpoints / step / "trainer_state.json").read_text())
        assert state["extra"]["trackers"] == {"tensorboard": {"logging_dir": "tensorboard"}}, step


# ---------------------------------------------------------------------------------------- TensorBoard, in process


def test_tensorboard_purges_steps_after_the_resumed_checkpoint_and_shows_samples(tmp_path):
    # The unit form of the resume test: without purge_step the series would hold steps 3 and 4 twice.
    first = MetricsLogger(tmp_path, enabled=True, total_steps=4, report_to=["tensorboard"], stream=io.StringIO())
    for step in range(1, 5):
        first.log({"step": step, "loss": float(step)})
    state = first.tracker_state()  # as a checkpoint would have kept it
    first.close()
    resumed = MetricsLogger(
        tmp_path, enabled=True, total_steps=4, start_step=2, report_to=["tensorboard"], tracker_state=state,
        stream=io.StringIO(),
    )  # fmt: skip
    for step in (3, 4):
        resumed.log({"step": step, "loss": 10.0 * step})
    rows = [{"step": 4, "prompt": "Which colour | shape?", "images": ["a.png"], "reference": "red", "reply": "red\nok"}]
    resumed.log_samples(4, rows)
    resumed.close()
    assert _scalars(tmp_path / "tensorboard", "loss") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    (text,) = _events(tmp_path / "tensorboard").Tensors("samples/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 4
    assert table.splitlines()[0] == "| step | prompt | images | reference | reply |"
    assert '| 4 | Which colour \\| shape? | ["a.png"] | red | red<br>ok |' in table


# ------------------------------------------------------------------- W&B, MLflow, trackio against fake trackers


class _FakeTracker:
    """Stands in for an accelerate tracker class: records how it was built and called."""

    built: ClassVar[list[_FakeTracker]] = []

    def __init__(self, *args, **kwargs) -> None:
        self.args, self.kwargs, self.calls = args, kwargs, []
        _FakeTracker.built.append(self)

    @property
    def tracker(self):  # W&B's run.id, MLflow's active_run.info.run_id, trackio's run.name
        return SimpleNamespace(id="wandb-1", info=SimpleNamespace(run_id="mlflow-1"), name=self.kwargs.get("name"))

    def start(self) -> None:
        self.calls.append(("start",))

    def store_init_configuration(self, values: dict) -> None:
        self.calls.append(("config", values))

    def log(self, values: dict, step: int | None = None) -> None:
        self.calls.append(("log", values, step))

    def log_table(self, name: str, columns=None, data=None, step=None) -> None:
        self.calls.append(("table", name, columns, data, step))

    def finish(self) -> None:
        self.calls.append(("finish",))


@pytest.fixture
def fakes(monkeypatch) -> dict:
    """The three accelerate classes replaced, their packages 'installed', and fake mlflow / trackio modules."""
    import accelerate.tracking

    _FakeTracker.built = []
    for cls in ("WandBTracker", "MLflowTracker", "TrackioTracker"):
        monkeypatch.setattr(accelerate.tracking, cls, _FakeTracker)
    find_spec = importlib.util.find_spec
    fake_spec = SimpleNamespace(name="fake")
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: fake_spec if name in ("wandb", "mlflow", "trackio") else find_spec(name, *a),
    )
    logged: dict = {"mlflow": [], "trackio": []}
    mlflow = types.ModuleType("mlflow")
    mlflow.log_table = lambda data, artifact_file: logged["mlflow"].append((data, artifact_file))
    trackio = types.ModuleType("trackio")
    trackio.Table = lambda dataframe: ("table", dataframe.columns.tolist(), dataframe.values.tolist())
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    return logged


ROWS = [{"step": 3, "prompt": "Colour?", "images": ["a.png"], "reference": "red", "reply": "blue", "correct": False}]
COLUMNS = ["step", "prompt", "images", "reference", "reply", "correct"]
CELLS = [[3, "Colour?", '["a.png"]', "red", "blue", False]]
WIRING = {
    # name: (how a new run is built, its state, what a resume adds to the build)
    "wandb": (
        (("proj",), {"name": "run-a", "dir": "OUT"}),
        {"id": "wandb-1", "project": "proj"},
        {"id": "wandb-1", "resume": "allow"},
    ),
    "mlflow": (
        ((), {"experiment_name": "proj", "run_id": None, "run_name": "run-a"}),
        {"run_id": "mlflow-1", "experiment": "proj"},
        {"run_id": "mlflow-1"},
    ),
    "trackio": (
        (("proj",), {"name": "run-a"}),
        {"project": "proj", "name": "run-a"},
        {"name": "run-a", "resume": "allow"},
    ),
}


@pytest.mark.parametrize("name", sorted(WIRING))
def test_tracker_wiring_config_table_and_resume(name, fakes, tmp_path):
    # Fails when a tracker is built without its resume id, stores the config again on resume, drops a number, or
    # logs no table.
    (args, kwargs), state, resume_kwargs = WIRING[name]
    kwargs = {k: str(tmp_path) if v == "OUT" else v for k, v in kwargs.items()}
    config = {"train": {"lr": 0.001, "betas": [0.9, 0.98], "resume": None}}
    common = {"enabled": True, "total_steps": 6, "report_to": [name], "project": "proj", "stream": io.StringIO()}
    metrics = MetricsLogger(tmp_path, run_config=config, run_name="run-a", **common)
    (fake,) = _FakeTracker.built
    assert (fake.args, fake.kwargs) == (args, kwargs)
    assert fake.calls == [
        ("start",),
        ("config", {"train.lr": 0.001, "train.betas": "[0.9, 0.98]", "train.resume": None}),
    ]
    metrics.log({"step": 2, "loss": 0.5, "eval_gen_acc_colour": 1.0, "images": 3, "mfu": None, "note": "x"})
    assert fake.calls[-1] == ("log", {"loss": 0.5, "eval_gen_acc_colour": 1.0, "images": 3}, 2)
    metrics.log_samples(3, ROWS)
    if name == "wandb":
        assert fake.calls[-1] == ("table", "samples", COLUMNS, CELLS, 3)
    elif name == "mlflow":
        assert fakes["mlflow"] == [
            ({c: [v] for c, v in zip(COLUMNS, CELLS[0], strict=True)}, "samples/step-000003.json")
        ]
    else:
        assert fake.calls[-1] == ("log", {"samples": ("table", COLUMNS, CELLS)}, 3)
    saved = json.loads(json.dumps(metrics.tracker_state()))  # through JSON, as the checkpoint keeps it
    assert saved == {name: state}
    metrics.close()
    assert fake.calls[-1] == ("finish",)

    resumed = MetricsLogger(tmp_path, start_step=2, run_name="renamed", tracker_state=saved, **common)
    again = _FakeTracker.built[-1]
    assert again is not fake and resume_kwargs.items() <= again.kwargs.items()
    assert again.calls == [("start",)]  # the tracker run holds the config already
    assert resumed.tracker_state() == saved


def test_missing_package_fails_with_the_pip_install(monkeypatch, tmp_path):
    # Fails when the check is skipped (the error would come from an import at the first log, or never).
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"pip install mlflow \(or pip install -e \"\.\[mlflow\]\"\)"):
        trackers.check_installed(["tensorboard", "mlflow"])
    with pytest.raises(ConfigError, match="pip install mlflow"):
        MetricsLogger(tmp_path, enabled=True, total_steps=1, report_to=["mlflow"], stream=io.StringIO())
    trackers.check_installed(["tensorboard"])
    trackers.check_installed(["none"])


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_training_refuses_a_missing_tracker_before_writing_anything(tmp_path, capsys):
    # Fails when the check only runs in MetricsLogger, after the data and the model are prepared (config.json is
    # written at the very start of set-up). The trainer's main in this process, as for the refusals of
    # test_checkpoint_integrity: a launch would spend its seconds importing.
    from vlm_sft.train import main

    code, err = main(tiny_run_args(tmp_path, **{"train.report_to": "wandb"})), capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "config error" in err and "pip install wandb" in err
    assert not (tmp_path / "run" / "config.json").exists()


def test_report_to_none_and_a_tracker_together_is_refused_with_the_fix():
    assert TrainConfig().report_to == ["none"]
    assert TrainConfig(report_to=[]).report_to == []
    assert TrainConfig(report_to="wandb").report_to == ["wandb"]  # --train.report_to wandb
    assert TrainConfig(report_to=None).report_to == ["none"]  # --train.report_to none
    with pytest.raises(ValidationError, match=r"set train.report_to = \['wandb'\]"):
        TrainConfig(report_to=["none", "wandb"])
    with pytest.raises(ValidationError, match="more than once"):
        TrainConfig(report_to=["tensorboard", "tensorboard"])
    with pytest.raises(ValidationError):
        TrainConfig(report_to=["comet"])
    assert trackers.tracker_names(["none"]) == []
