"""LoRA exports: a merged plain checkpoint, or a PEFT adapter folder, from the state dict of an adapted model.

The trainer attaches adapters with ``peft.inject_adapter_in_model`` (adapter name ``default``), so the adapted
model's state dict holds, for each adapted linear ``X``::

    X.base_layer.weight            the frozen base weight            [out, in]
    X.lora_A.default.weight        A                                 [r, in]
    X.lora_B.default.weight        B                                 [out, r]

and the layer computes ``x @ (W + alpha / r * B @ A).T`` (peft's ``scaling = lora_alpha / r`` without rsLoRA).
Two ways out, both loadable without our code:

* ``merged_state_dict``: the plain model's state dict with ``W + alpha / r * B @ A`` folded in (transformers and vLLM
  load it as a full model); ``export`` does the same merge module by module while it streams a sharded model.
* ``save_adapter``: ``adapter_model.safetensors`` + ``adapter_config.json`` in the layout
  ``peft.PeftModel.from_pretrained`` reads onto transformers' ``Qwen3_5ForConditionalGeneration``, whose module paths
  equal ours (``model.language_model.layers.0.mlp.gate_proj``). Keys are ``base_model.model.X.lora_A.weight``: what
  ``get_peft_model_state_dict`` writes (the PeftModel's ``base_model.model.`` prefix, the adapter name removed).

Inputs are full (unsharded) state dicts; ``export.export_adapter`` gathers a sharded model's trainable tensors.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from vlm_sft.model.lora import ADAPTER_NAME, is_saved_module  # ADAPTER_NAME: left out of PEFT files' keys
from vlm_sft.parallel.fsdp import is_sharded

PEFT_PREFIX = "base_model.model."
"""What a PeftModel (LoraModel inside PeftModel) puts before the wrapped model's parameter names."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_LAYER = ".base_layer."
LORA_A = f".lora_A.{ADAPTER_NAME}.weight"
LORA_B = f".lora_B.{ADAPTER_NAME}.weight"


def lora_modules(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the adapted modules, checked to hold exactly A and B of the one supported adapter."""
    lora_keys = [k for k in state if ".lora_" in k]
    modules = sorted(k.removesuffix(LORA_A) for k in lora_keys if k.endswith(LORA_A))
    expected = {m + s for m in modules for s in (LORA_A, LORA_B)}
    if set(lora_keys) != expected:
        odd = sorted(set(lora_keys) ^ expected)
        raise ValueError(
            f"LoRA keys other than '<module>{LORA_A}' / '<module>{LORA_B}' pairs: {odd[:6]}; only plain LoRA "
            f"(no DoRA, embeddings, or adapters other than '{ADAPTER_NAME}') is exported"
        )
    return modules


def _check_full(state: dict[str, torch.Tensor]) -> None:
    """Sharded DTensors would be written as one rank's shard: ask for the gathered state dict instead."""
    sharded = [k for k, v in state.items() if is_sharded(v)]
    if sharded:
        raise ValueError(
            f"state dict holds sharded tensors ({sharded[:3]}); pass the full state dict "
            "(vlm_sft.checkpoint.export.export_adapter gathers a sharded model's trainable tensors one by one)"
        )


def merged_state_dict(state: dict[str, torch.Tensor], *, alpha: float, r: int) -> dict[str, torch.Tensor]:
    """The plain model's state dict: each adapted ``X.weight = base + alpha / r * B @ A``, other keys as they are.

    The product is taken in float32 and cast back to the base's dtype, so a bf16 base gets one rounding, not three.
    ``X.base_layer.*`` keys (weight, and bias where there is one) lose their ``base_layer`` segment; LoRA keys are
    dropped. ``r`` is checked against A's shape: a wrong ``r`` would silently rescale the update.
    """
    _check_full(state)
    modules = lora_modules(state)
    out = {k.replace(BASE_LAYER, "."): v for k, v in state.items() if ".lora_" not in k}
    for m in modules:
        base_key = m + BASE_LAYER + "weight"
        if base_key not in state:
            raise ValueError(f"{m}: LoRA weights without a base weight ({base_key})")
        a, b, base = state[m + LORA_A], state[m + LORA_B], state[base_key]
        if a.shape[0] != r or b.shape[1] != r:
            raise ValueError(f"{m}: A {tuple(a.shape)} and B {tuple(b.shape)} have rank {a.shape[0]}, not r={r}")
        delta = (alpha / r) * (b.float() @ a.float())
        out[m + ".weight"] = (base.float() + delta.to(base.device)).to(base.dtype)
    return out


def saved_module_keys(state: dict[str, torch.Tensor], modules_to_save: Sequence[str]) -> list[str]:
    """Keys of the fully trained ``modules_to_save`` (``lm_head.weight``, ``model.language_model.embed_tokens.weight``),
    by the rule the trainer unfreezes them with (``lora.is_saved_module``)."""
    return [k for k in state if "." in k and is_saved_module(k.rsplit(".", 1)[0], modules_to_save)]


def adapter_state_dict(state: dict[str, torch.Tensor], modules_to_save: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """The adapter tensors under the keys PEFT files use: ``base_model.model.X.lora_A.weight`` (no adapter name),
    and each ``modules_to_save`` tensor as ``base_model.model.lm_head.weight`` (peft's ``ModulesToSaveWrapper`` saves
    its trained copy without its ``modules_to_save.default`` segment and restores it on load)."""
    _check_full(state)
    out: dict[str, torch.Tensor] = {}
    for m in lora_modules(state):
        for part, key in (("lora_A", LORA_A), ("lora_B", LORA_B)):
            out[f"{PEFT_PREFIX}{m}.{part}.weight"] = state[m + key]
    saved = saved_module_keys(state, modules_to_save)
    found = {k.rsplit(".", 2)[-2] for k in saved}
    if set(modules_to_save) - found:
        raise ValueError(f"modules_to_save {sorted(set(modules_to_save) - found)} name no tensor of the state dict")
    out.update({f"{PEFT_PREFIX}{k}": state[k] for k in saved})
    return out


def _matches(module: str, target_modules: Sequence[str]) -> bool:
    """peft's rule for a list of targets: the full name, or a suffix that starts at a dot."""
    return any(module == t or module.endswith("." + t) for t in target_modules)


def _check_targets(parameter_names: Sequence[str], modules: list[str], target_modules: Sequence[str]) -> None:
    """The targets written to the config must select the adapted modules and no others when PEFT loads them.

    A short name that also names a vision-tower linear (``proj``, ``qkv``) would make PeftModel add adapters there
    that the file does not hold: its missing-keys warning then fires, and the tower runs with zero-initialized B.
    """
    weighted = {
        k.removesuffix(".weight").removesuffix(BASE_LAYER.rstrip(".")) for k in parameter_names if k.endswith(".weight")
    }
    selected = {n for n in weighted if ".lora_" not in n and _matches(n, target_modules)}
    if selected != set(modules):
        extra, unmatched = sorted(selected - set(modules)), sorted(set(modules) - selected)
        raise ValueError(
            f"target_modules {list(target_modules)[:6]} do not select exactly the adapted modules: they would also "
            f"adapt {extra[:4]} and miss {unmatched[:4]}; pass the adapted modules' full names"
        )


def save_adapter(
    directory: str | os.PathLike,
    state: dict[str, torch.Tensor],
    *,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: Sequence[str],
    base_model_name_or_path: str,
    modules_to_save: Sequence[str] = (),
    parameter_names: Sequence[str] | None = None,
) -> Path:
    """Writes a PEFT LoRA adapter folder that ``PeftModel.from_pretrained(base, directory)`` loads; returns it.

    ``state`` is the adapted model's state dict (base weights are not written). ``target_modules`` are the names
    peft will match in the base model (full module names or suffixes); they are checked to select exactly the
    modules that have adapters among ``parameter_names``: the adapted model's parameter names (default: the keys of
    ``state``, which then must hold the base weights too). ``modules_to_save`` (``lm_head``, ``embed_tokens``) are
    written whole. ``task_type`` is ``CAUSAL_LM``, what tools that serve text-generation adapters (vLLM, the hub)
    expect; the key layout does not depend on it.
    """
    from peft import LoraConfig  # only needed to export adapters; keeps peft off the plain model's import path

    modules = lora_modules(state)
    if not modules:
        raise ValueError("state dict has no LoRA weights: was the adapter injected before taking the state dict?")
    _check_targets(list(state) if parameter_names is None else parameter_names, modules, target_modules)
    for m in modules:
        if state[m + LORA_A].shape[0] != r:
            raise ValueError(f"{m}: A has rank {state[m + LORA_A].shape[0]}, not r={r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter_state_dict(state, modules_to_save).items()}
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        modules_to_save=list(modules_to_save) or None,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
    )
    config.save_pretrained(str(directory))
    return directory
