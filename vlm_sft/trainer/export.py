"""The HF export of a run: ``final/`` (and ``checkpoints/step-N/hf``), loadable by transformers, vLLM and peft."""

from __future__ import annotations

from pathlib import Path

import torch

from processors import save_processor
from vlm_sft.config import RunConfig
from vlm_sft.model.checkpoint_io import save_hf_checkpoint
from vlm_sft.model.lora_export import merged_state_dict, save_adapter
from vlm_sft.trainer.checkpoint import full_state_dict
from vlm_sft.trainer.distributed import DistEnv, all_ranks_or_none


def export_final(
    directory: Path, model: torch.nn.Module, processor, env: DistEnv, cfg: RunConfig, *, merge: bool | None = None
) -> Path:
    """Write the HF checkpoint: weights + config, then processor and tokenizer (tokenizer last, verified on reload).

    LoRA runs write the adapter in PEFT's format to ``<directory>/adapter`` and, when ``merge`` (default:
    ``train.merge_lora``), the merged full weights (base + adapter) as the HF checkpoint itself. Without the merged
    copy only the trainable tensors are gathered (the frozen base is not read at all)."""
    lora = cfg.model.lora
    merge = cfg.train.merge_lora if merge is None else merge
    state = full_state_dict(model, trainable_only=lora is not None and not merge)
    names = [n for n, _ in model.named_parameters()]
    with all_ranks_or_none(env, f"writing the checkpoint {directory}"):
        if env.is_main:
            if lora is not None:
                save_adapter(
                    directory / "adapter", state, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                    target_modules=list(lora.target_modules), base_model_name_or_path=cfg.model.name_or_path,
                    modules_to_save=list(lora.modules_to_save), parameter_names=names,
                )  # fmt: skip
                state = merged_state_dict(state, alpha=lora.alpha, r=lora.r) if merge else None
            if state is not None:
                if model.tied_embeddings:
                    state.pop("lm_head.weight", None)
                save_hf_checkpoint(state, model.config, directory)
                save_processor(directory, processor, processor.tokenizer)
    return directory
