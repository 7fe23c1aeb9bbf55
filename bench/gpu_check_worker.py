"""The pieces of the GPU check that need torch and the model, each run by ``bench/gpu_check.py`` as a subprocess.

    python bench/gpu_check_worker.py --json OUT.json env
    python bench/gpu_check_worker.py --json OUT.json write-model DIR [--smoke]
    python bench/gpu_check_worker.py --json OUT.json reload FINAL [--other FINAL2]

Why subprocesses: each gets a time limit, its own log and its own GPU memory, and a crash (or a hang) in one is
recorded by the check, which then goes on with the next part. Each command writes its figures to OUT.json.

- ``env``: versions of torch, transformers, triton, flash-linear-attention, flash-attn, causal-conv1d; the device;
  the kernels the backend registry picks there.
- ``write-model``: a randomly initialised model of the Qwen3.5-0.8B shape (``vlm_sft.model.presets.qwen3_5_0_8b_config``,
  all 24 layers; ``--smoke``: 2 layers, 1 GatedDeltaNet + 1 full attention, small vision) saved as an HF checkpoint
  directory with the tiny offline processor. Its special-token ids are the tiny tokenizer's, so the directory is
  self-consistent (the tiny ids are all below the 248,320-token vocabulary).
- ``reload``: ``final/`` loaded by ``vlm_sft.checkpoint.load.from_pretrained`` and by transformers'
  ``Qwen3_5ForConditionalGeneration.from_pretrained``; both score the processor's probe conversation (text + image)
  in float32 on the device and the logits are compared. ``--other``: the largest weight difference to another
  final checkpoint (the resumed run's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness and gpu_bench, beside this file

import harness  # first: the CPU environment, before torch is imported

# isort: split
import torch

DISTRIBUTIONS = (
    *("torch", "transformers", "triton", "flash-linear-attention", "fla-core", "flash-attn", "causal-conv1d"),
    *("accelerate", "datasets", "pyarrow", "pydantic", "regex", "tokenizers", "safetensors", "numpy", "pytest"),
)
"""Packages whose versions the check records (None: not installed): the kernels' and the ones a GPU image may lack
or hold in another version (see the wheel list in bench/README.md)."""


def environment() -> dict:
    from vlm_sft.model.backends import resolve_backends

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    chosen = resolve_backends(device)
    return {
        "python": platform.python_version(),
        "versions": {dist: harness.package_version(dist) for dist in DISTRIBUTIONS},
        "cuda_available": cuda,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({os.cpu_count()} cores)",
        "device_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
        "kernels": {k: getattr(chosen, k) for k in ("attention", "linear_attention", "conv", "loss")},
    }


def model_config(tokenizer, *, smoke: bool):
    """The 0.8B shape (or its 2-layer smoke copy) with the tiny tokenizer's special-token ids."""
    from gpu_bench import shrink

    from processors.special_tokens import EOS_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN, VISION_END_TOKEN, VISION_START_TOKEN
    from vlm_sft.model.presets import qwen3_5_0_8b_config

    config = qwen3_5_0_8b_config()
    if smoke:
        config = shrink(config)
        text = config.text_config
        text.num_hidden_layers, text.layer_types = 2, ["linear_attention", "full_attention"]
    ids = tokenizer.convert_tokens_to_ids
    config.image_token_id, config.video_token_id = ids(IMAGE_TOKEN), ids(VIDEO_TOKEN)
    config.vision_start_token_id, config.vision_end_token_id = ids(VISION_START_TOKEN), ids(VISION_END_TOKEN)
    config.text_config.pad_token_id = tokenizer.pad_token_id
    config.text_config.eos_token_id = ids(EOS_TOKEN)
    used = [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    used += [config.text_config.pad_token_id, config.text_config.eos_token_id]
    assert all(0 <= i < config.text_config.vocab_size for i in used), (used, config.text_config.vocab_size)
    return config


def write_model(directory: Path, *, smoke: bool) -> dict:
    from processors import load_tiny_processor, save_processor
    from vlm_sft.checkpoint.export import save_pretrained
    from vlm_sft.model import build_model

    t0 = time.perf_counter()
    processor = load_tiny_processor()
    config = model_config(processor.tokenizer, smoke=smoke)
    torch.manual_seed(0)
    model = build_model(config)  # on the CPU in float32: nothing runs here, the trainer loads it onto the device
    save_pretrained(model, directory)
    save_processor(directory, processor, processor.tokenizer)
    text, vision = config.text_config, config.vision_config
    return {
        "dir": str(directory),
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": text.num_hidden_layers,
        "linear_attention_layers": sum(t == "linear_attention" for t in text.layer_types),
        "hidden_size": text.hidden_size,
        "vocab_size": text.vocab_size,
        "vision": f"{vision.depth} x {vision.hidden_size}",
        "image_token_id": config.image_token_id,
        "seconds": time.perf_counter() - t0,
    }


def probe_logits(final: Path, device: torch.device) -> dict:
    """Logits of the probe conversation from both loaders, float32 on ``device``; their largest difference."""
    from transformers import Qwen3_5ForConditionalGeneration

    from processors import load_processor
    from processors.loading import probe_conversation
    from vlm_sft.checkpoint.load import from_pretrained
    from vlm_sft.data.mrope import batch_position_ids

    processor = load_processor(final)
    inputs = processor.apply_chat_template(
        probe_conversation(), add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    ids, mm, pixels, grid = (inputs[k] for k in ("input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw"))
    with torch.no_grad():
        ours = from_pretrained(final, device=device).eval()
        got = ours(
            ids.to(device),
            position_ids=batch_position_ids(mm, grid).to(device),
            pixel_values=pixels.to(device),
            image_grid_thw=grid.to(device),
            mm_token_type_ids=mm.to(device),
        ).float()
        del ours
        theirs = Qwen3_5ForConditionalGeneration.from_pretrained(final, dtype=torch.float32).to(device).eval()
        ref = theirs(
            input_ids=ids.to(device), pixel_values=pixels.to(device), image_grid_thw=grid.to(device),
            mm_token_type_ids=mm.to(device),
        ).logits.float()  # fmt: skip
    diff = float((got - ref).abs().max())
    scale = float(ref.abs().max())
    return {
        "tokens": int(ids.numel()),
        "finite": bool(torch.isfinite(got).all() and torch.isfinite(ref).all()),
        "max_abs_logit_diff": diff,
        "max_abs_logit": scale,
        "rel_logit_diff": diff / max(scale, 1e-12),
    }


def _weights(final: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(final.glob("*.safetensors")):
        out |= load_file(shard)
    return out


def weight_diff(final: Path, other: Path) -> dict:
    """Largest |a - b| over all tensors of two checkpoints, absolute and relative to that tensor's largest |a|."""
    a, b = _weights(final), _weights(other)
    if a.keys() != b.keys():
        return {"same_keys": False, "only_in_first": sorted(a.keys() - b.keys())[:5]}
    worst_abs, worst_rel, worst_key = 0.0, 0.0, None
    for key, ta in a.items():
        d = float((ta.float() - b[key].float()).abs().max())
        rel = d / max(float(ta.float().abs().max()), 1e-12)
        worst_abs = max(worst_abs, d)
        if rel >= worst_rel:
            worst_rel, worst_key = rel, key
    return {"same_keys": True, "tensors": len(a), "max_abs_diff": worst_abs, "max_rel_diff": worst_rel, "at": worst_key}


def reload(final: Path, other: Path | None) -> dict:
    t0 = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = {"final": str(final), "device": str(device), **probe_logits(final, device)}
    if other is not None:
        out["vs_resumed"] = weight_diff(final, other)
    out["seconds"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True, help="where to write the figures")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("env")
    w = sub.add_parser("write-model")
    w.add_argument("dir", type=Path)
    w.add_argument("--smoke", action="store_true")
    r = sub.add_parser("reload")
    r.add_argument("final", type=Path)
    r.add_argument("--other", type=Path)
    args = ap.parse_args()
    if args.command == "env":
        result = environment()
    elif args.command == "write-model":
        result = write_model(args.dir, smoke=args.smoke)
    else:
        result = reload(args.final, args.other)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
