"""LoRA through peft: configs that cannot work are refused with the fix, and a LoRA run trains only the adapters (the
base weights stay bitwise unchanged) and writes a PEFT adapter beside the merged weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_helpers import run_training, tiny_run_args

from vlm_sft.config import ConfigError, load_config
from vlm_sft.trainer import build

LORA = {"model.lora.r": 4, "model.lora.alpha": 8, "model.vlm.freeze_vision": True}


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["--model.lora.r", "4"], "freeze_vision = true"),  # debug.toml trains the tower
        (["--model.lora.target_modules", '["qkv"]'], "vision-tower"),
        (["--model.lora.target_modules", '["attn_out"]'], "available: q_proj"),
        (["--model.lora.target_modules", '["in_proj_b"]'], "in_proj_ba"),
    ],
)
def test_configs_that_cannot_work_are_refused_with_the_fix(overrides, needle):
    frozen = [] if overrides[0] == "--model.lora.r" else ["--model.vlm.freeze_vision", "true"]
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [*overrides, *frozen])


def test_partial_fused_group_is_accepted_only_when_asked():
    cfg = load_config(
        None,
        ["--model.vlm.freeze_vision", "true", "--model.lora.target_modules", '["in_proj_b", "q_proj"]',
         "--model.lora.allow_partial_fused", "true"],
    )  # fmt: skip
    assert cfg.model.lora.target_modules == ["in_proj_b", "q_proj"]


def test_only_the_text_models_adapters_train():
    cfg = load_config(None, ["--model.vlm.freeze_vision", "true", "--model.lora.r", "4"])
    model = build.build_model(cfg, torch.device("cpu"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(n.startswith("model.language_model.") for n in trainable)  # never the vision tower
    adapted = {n.rsplit(".", 3)[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == set(cfg.model.lora.target_modules)


def _dcp_model_state(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(tmp / "ckpt.pt"))
    return torch.load(tmp / "ckpt.pt", weights_only=False)["model"]


def _assert_only_adapters_moved(run: Path, args: list[str], tmp: Path) -> None:
    """Base weights bitwise equal to the run's start (rebuilt from the same seeds), adapters trained."""
    cfg = load_config(None, args)
    start = build.build_model(cfg, torch.device("cpu")).state_dict()
    after = _dcp_model_state(run / "checkpoints" / "step-000002", tmp)
    assert after.keys() == start.keys()
    base = [k for k in start if ".lora_" not in k]
    assert all(torch.equal(after[k], start[k]) for k in base), "a base weight moved"
    assert any(not torch.equal(after[k], start[k]) for k in start if ".lora_B." in k), "the adapters did not train"


def _assert_adapter_and_merged_written(final: Path) -> None:
    config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == "tiny"
    assert (final / "adapter" / "adapter_model.safetensors").is_file()
    assert (final / "config.json").is_file() and (final / "tokenizer.json").is_file()  # merged weights + processor


def test_packed_rows_give_the_adapters_the_gradient_of_each_sample_alone(tmp_path):
    """The packing self-check on a LoRA model: every lora_B randomized first (peft starts it at zero, which would
    leave lora_A without any gradient to compare), dropout 0."""
    from vlm_sft.trainer.self_check import run_packing_check

    args = tiny_run_args(tmp_path, **LORA)
    cfg = load_config(None, args)
    processor = build.build_processor(cfg)
    model = build.build_model(cfg, torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.05)
    report = run_packing_check(
        cfg, model=model, renderer=build.build_renderer(cfg, processor), source=build.load_sources(cfg).train,
        pad_id=int(processor.tokenizer.pad_token_id), rows=1,
    )  # fmt: skip
    assert report.ok, report.format()
    assert ".lora_" in report.format().split("grad (relative)")[1].splitlines()[0]  # gradients are the adapters'


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "adapter" / "adapter_model.safetensors")


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys() and a
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= tol, worst


@pytest.mark.slow
def test_lora_runs_train_only_adapters_match_across_ranks_and_resume_exactly(tmp_path):
    """A 1-rank LoRA run (2 data shares x 4 micro-batches) moves only the adapters and writes the PEFT adapter and
    the merged weights; 2 ranks x 2 micro-batches train the same adapters; resuming the 1-rank run from its step-1
    checkpoint (adapter, optimizer state, data position) ends with the same adapters."""
    common = {**LORA, "train.max_steps": 3, "train.save_every": 1}
    one = tmp_path / "one"
    one_args = tiny_run_args(one, **common, **{"train.micro_batches": 4, "data.num_workers": 2})
    run_training(one_args)
    _assert_only_adapters_moved(one / "run", one_args, tmp_path)
    _assert_adapter_and_merged_written(one / "run" / "final")
    two = tmp_path / "two"
    run_training(tiny_run_args(two, **common, **{"train.micro_batches": 2}), nproc=2)
    _assert_close(_adapter(one / "run"), _adapter(two / "run"), 1e-5)

    resumed = tmp_path / "resumed"
    checkpoint = one / "run" / "checkpoints" / "step-000001"
    run_training(
        tiny_run_args(
            resumed, **common, **{"train.micro_batches": 4, "data.num_workers": 2, "train.resume": str(checkpoint)}
        )
    )
    _assert_close(_adapter(one / "run"), _adapter(resumed / "run"), 0.0)
