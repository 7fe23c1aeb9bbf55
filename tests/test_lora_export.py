"""LoRA exports against the adapted model: the merged checkpoint and the PEFT adapter folder give its logits, in our
model and in transformers (+ peft), on text and an image."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, PeftModel, inject_adapter_in_model
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForConditionalGeneration

from vlm_sft.checkpoint.export import save_pretrained
from vlm_sft.checkpoint.lora_export import ADAPTER_WEIGHTS, adapter_state_dict, merged_state_dict, save_adapter
from vlm_sft.data.mrope import batch_position_ids
from vlm_sft.model import build_model, tiny_qwen3_5_config

R, ALPHA = 4, 8.0
PATCH_ROW = 3 * 2 * 16 * 16  # channels x temporal patch x patch x patch of the tiny vision tower


@pytest.fixture(scope="module")
def cfg():
    return tiny_qwen3_5_config()


def text_linears(model: torch.nn.Module) -> list[str]:
    return sorted(
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.language_model.")
    )


@pytest.fixture(scope="module")
def adapted(cfg):
    """(plain base state, adapted model, its state, target names): LoRA on every text linear, B made non-zero."""
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32).eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    targets = text_linears(model)
    inject_adapter_in_model(LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets), model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.05)  # peft starts B at zero: every export would equal the base model
    return base, model, {k: v.detach().clone() for k, v in model.state_dict().items()}, targets


@pytest.fixture(scope="module")
def batch(cfg):
    """One sample: text, an image (grid 1x4x6 -> 6 tokens), text."""
    gen = torch.Generator().manual_seed(1)
    vs, ve, img = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id
    text = torch.randint(0, 2048, (14,), generator=gen).tolist()
    input_ids = torch.tensor([text[:5] + [vs] + [img] * 6 + [ve] + text[5:]])
    grids = torch.tensor([[1, 4, 6]])
    return {
        "input_ids": input_ids,
        "mm_token_type_ids": (input_ids == img).long(),
        "pixel_values": torch.randn(int(grids.prod(-1).sum()), PATCH_ROW, generator=gen),
        "image_grid_thw": grids,
    }


@torch.no_grad()
def ours_logits(model, b: dict) -> torch.Tensor:
    pos = batch_position_ids(b["mm_token_type_ids"], b["image_grid_thw"])
    return model(b["input_ids"], position_ids=pos, **{k: v for k, v in b.items() if k != "input_ids"})


@torch.no_grad()
def theirs_logits(model, b: dict) -> torch.Tensor:
    return model(**b).logits


def close(got: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5) -> bool:
    return float((got - ref).abs().max()) <= tol * float(ref.abs().max())


@pytest.fixture(scope="module")
def expected(adapted, batch, cfg):
    """The adapted model's logits, checked to be far from the base model's so that matching them means something."""
    base, model, _, _ = adapted
    ref = ours_logits(model, batch)
    plain = build_model(cfg, dtype=torch.float32).eval()
    plain.load_state_dict(base)
    assert not close(ours_logits(plain, batch), ref, tol=1e-2), "the adapters barely change the logits"
    return ref


def test_merged_state_dict_gives_the_adapted_logits(adapted, batch, cfg, expected):
    base, _, state, _ = adapted
    merged = merged_state_dict(state, alpha=ALPHA, r=R)
    assert merged.keys() == base.keys()
    plain = build_model(cfg, dtype=torch.float32).eval()
    plain.load_state_dict(merged, strict=True)
    assert close(ours_logits(plain, batch), expected)
    # A wrong scale (alpha / r off by 2x) is caught by the same bound.
    plain.load_state_dict(merged_state_dict(state, alpha=ALPHA / 2, r=R))
    assert not close(ours_logits(plain, batch), expected, tol=1e-3)
    with pytest.raises(ValueError, match="not r=8"):
        merged_state_dict(state, alpha=ALPHA, r=2 * R)


def test_merged_bf16_base_rounds_once(adapted):
    _, _, state, _ = adapted
    key = next(k for k in state if k.endswith(".base_layer.weight"))
    bf16 = {k: v.to(torch.bfloat16) if k.endswith(".base_layer.weight") else v for k, v in state.items()}
    merged = merged_state_dict(bf16, alpha=ALPHA, r=R)
    name = key.replace(".base_layer.", ".")
    assert merged[name].dtype == torch.bfloat16
    m = key.removesuffix(".base_layer.weight")
    exact = bf16[key].float() + ALPHA / R * state[f"{m}.lora_B.default.weight"] @ state[f"{m}.lora_A.default.weight"]
    assert torch.equal(merged[name], exact.to(torch.bfloat16))


def test_merged_checkpoint_loads_in_transformers(adapted, batch, expected, tmp_path):
    """The trainer's export of the adapted model (merged module by module as it streams)."""
    _, model, _, _ = adapted
    save_pretrained(model, tmp_path, lora=SimpleNamespace(r=R, alpha=ALPHA))
    theirs = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert close(theirs_logits(theirs, batch), expected)


def _load_with_peft(base_dir, adapter_dir):
    """(peft model, load result, peft's warnings): the load result of loading the folder's weights again."""
    base = Qwen3_5ForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    result = peft_model.load_adapter(adapter_dir, adapter_name="default")
    return peft_model, result, [str(w.message) for w in caught if "adapter keys" in str(w.message)]


@pytest.fixture(scope="module")
def folders(adapted, cfg, tmp_path_factory):
    """(base HF dir without LoRA, adapter folder)."""
    base, _, state, targets = adapted
    tmp = tmp_path_factory.mktemp("lora")
    plain = build_model(cfg, dtype=torch.float32)
    plain.load_state_dict(base)
    save_pretrained(plain, tmp / "base")
    save_adapter(
        tmp / "adapter",
        state,
        r=R,
        alpha=ALPHA,
        dropout=0.0,
        target_modules=targets,
        base_model_name_or_path=str(tmp / "base"),
    )
    return tmp / "base", tmp / "adapter"


def test_adapter_loads_in_peft_with_the_adapted_logits(adapted, batch, folders, expected):
    targets = adapted[3]
    peft_model, result, messages = _load_with_peft(*folders)
    assert not messages and result.missing_keys == [] and result.unexpected_keys == []
    adapted_names = {n for n, m in peft_model.base_model.model.named_modules() if hasattr(m, "lora_A") and m.lora_A}
    assert adapted_names == set(targets)
    assert close(theirs_logits(peft_model, batch), expected)
    saved = json.loads((folders[1] / "adapter_config.json").read_text())
    assert saved["r"] == R and saved["lora_alpha"] == ALPHA and saved["base_model_name_or_path"] == str(folders[0])
    assert len(load_file(folders[1] / ADAPTER_WEIGHTS)) == 2 * len(targets)


def test_adapter_keys_without_the_peft_prefix_load_nothing(folders, tmp_path):
    """The control: the same tensors under our own names (no ``base_model.model.``) leave every adapter missing."""
    base_dir, adapter_dir = folders
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(adapter_dir / ADAPTER_WEIGHTS)
    save_file({k.removeprefix("base_model.model."): v for k, v in tensors.items()}, str(bad / ADAPTER_WEIGHTS))
    _, result, messages = _load_with_peft(base_dir, bad)
    assert messages and len(result.missing_keys) == len(tensors) and result.unexpected_keys


def test_targets_that_reach_other_modules_are_refused(adapted, tmp_path):
    _, _, state, targets = adapted
    common = {"r": R, "alpha": ALPHA, "dropout": 0.0, "base_model_name_or_path": "base"}
    with pytest.raises(ValueError, match="would also adapt"):
        save_adapter(tmp_path, state, target_modules=[*targets, "proj"], **common)  # a vision-tower name
    with pytest.raises(ValueError, match="and miss"):
        save_adapter(tmp_path, state, target_modules=targets[1:], **common)
    short = sorted({t.rsplit(".", 1)[-1] for t in targets})
    save_adapter(tmp_path, state, target_modules=short, **common)  # suffixes that select exactly the same modules
    assert set(adapter_state_dict(state)) == set(load_file(tmp_path / ADAPTER_WEIGHTS))


def test_adapter_only_state_is_checked_against_the_models_parameter_names(adapted, tmp_path):
    """What a LoRA checkpoint export gathers (the trainable tensors only) writes the same folder, given the model's
    parameter names; without them the target check has no base module to match and refuses."""
    _, _, state, targets = adapted
    common = {"r": R, "alpha": ALPHA, "dropout": 0.0, "base_model_name_or_path": "base", "target_modules": targets}
    lora_only = {k: v for k, v in state.items() if ".lora_" in k}
    save_adapter(tmp_path / "a", lora_only, parameter_names=list(state), **common)
    save_adapter(tmp_path / "b", state, **common)
    a, b = load_file(tmp_path / "a" / ADAPTER_WEIGHTS), load_file(tmp_path / "b" / ADAPTER_WEIGHTS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="and miss"):
        save_adapter(tmp_path / "c", lora_only, **common)


def test_modules_to_save_travel_in_the_adapter_and_in_the_merge(adapted, batch, folders, tmp_path):
    """An lm_head trained in place beside the adapters (``modules_to_save``): peft restores it from the adapter
    folder (no missing or unexpected key) and gives the adapted model's logits; the merged weights carry it too."""
    import copy

    _, model, state, targets = adapted
    gen = torch.Generator().manual_seed(2)
    head = state["lm_head.weight"] + 0.05 * torch.randn(state["lm_head.weight"].shape, generator=gen)
    trained = copy.deepcopy(model)
    with torch.no_grad():
        trained.lm_head.weight.copy_(head)
    want = ours_logits(trained, batch)
    assert not close(want, ours_logits(model, batch), tol=1e-3), "the trained head barely changes the logits"
    state = {**state, "lm_head.weight": head}
    save_adapter(
        tmp_path, state, r=R, alpha=ALPHA, dropout=0.0, target_modules=targets,
        base_model_name_or_path=str(folders[0]), modules_to_save=["lm_head"],
    )  # fmt: skip
    assert "base_model.model.lm_head.weight" in load_file(tmp_path / ADAPTER_WEIGHTS)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head"]
    peft_model, result, messages = _load_with_peft(folders[0], tmp_path)
    assert not messages and result.missing_keys == [] and result.unexpected_keys == []
    assert close(theirs_logits(peft_model, batch), want)
    assert torch.equal(merged_state_dict(state, alpha=ALPHA, r=R)["lm_head.weight"], head)
    with pytest.raises(ValueError, match="name no tensor"):
        adapter_state_dict(state, ["norm_out"])
