"""One rank of the context-parallel parity test (``test_context_parallel.py``), launched by torchrun over gloo.

Every rank builds the same tiny model and the same packed row, computes the whole row alone (cp 1), then its shard
under cp = world size; it writes the gathered logits, the summed loss and gradients, and the vision tower's work to
``$CP_OUT/<dense|moe>-rank<R>.pt``, for the dense and the MoE tiny model. Then, on the dense model, a row rendered and
packed as the data path does (a video of a committed clip, an image, text): the whole row, its shard under cp, and each
sample alone in a row of its own, to ``$CP_OUT/video-rank<R>.pt``.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packing_helpers import make_sample, packed_batch

from processors import load_tiny_processor
from renderers import Qwen3_5Renderer
from renderers.parity import probe_image
from renderers.video import VideoSettings
from vlm_sft.data.collate import collate
from vlm_sft.data.pack import Pack
from vlm_sft.data.shift import shift_sample
from vlm_sft.model import build_model, tiny_qwen3_5_config, tiny_qwen3_5_moe_config
from vlm_sft.parallel.context_parallel import ContextParallel
from vlm_sft.parallel.parallelize import apply_context_parallel


def row(cfg):
    """64 tokens: text; an image sample straddling the cut at 32 (its image slots at 30-33); a text sample; a
    second image sample; padding."""
    gen = torch.Generator().manual_seed(5)
    samples = [
        make_sample(cfg, 24, [], 0, gen),  # 0-23
        make_sample(cfg, 5, [(1, 4, 4)], 6, gen),  # 24-40: image slots 30-33
        make_sample(cfg, 6, [], 0, gen),  # 41-46
        make_sample(cfg, 2, [(1, 4, 8)], 3, gen),  # 47-60: 8 slots
    ]
    return packed_batch(cfg, [samples], 64)


CLIP = Path(__file__).resolve().parent / "fixtures" / "video" / "a_64x48_24fps.mp4"


def video_row():
    """102 tokens, packed by the collator: a text sample (0-25); a video sample (26-73) whose 2 temporal groups of
    4 slots sit at 37-40 and 50-53, the second straddling the cut at 51; an image sample (74-98); padding. Also
    each sample alone, a batch of its own."""
    renderer = Qwen3_5Renderer(load_tiny_processor(), video_settings=VideoSettings(min_pixels=1024, max_pixels=16384))
    turns = [
        ("Count to three.", "One, two, three."),
        ([{"type": "video", "video": str(CLIP)}, {"type": "text", "text": "What moves?"}], "The red square."),
        ([{"type": "image", "image": probe_image(64, 64)}, {"type": "text", "text": "What colour?"}], "Yellow."),
    ]
    conversations = [[{"role": "user", "content": c}, {"role": "assistant", "content": a}] for c, a in turns]
    samples = [shift_sample(renderer.render(c, sample_index=k)) for k, c in enumerate(conversations)]
    alone = [collate([Pack(rows=((s,),), row_len=len(s))]) for s in samples]
    return collate([Pack(rows=(tuple(samples),), row_len=102)]), alone


def run(model, batch, cp_size: int):
    """(logits, loss sum, grads), all of the whole row, whatever the CP size."""
    model.zero_grad(set_to_none=True)
    kwargs = batch.model_kwargs()
    out = model(**kwargs)
    out.loss_sum.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    loss = out.loss_sum.detach().clone()
    with torch.no_grad():
        logits = model(**{k: v for k, v in kwargs.items() if k not in ("target_ids", "loss_mask")})
    if cp_size > 1:
        for g in grads.values():
            dist.all_reduce(g)  # the CP group's ranks hold shards of one row: gradients are summed
        dist.all_reduce(loss)
        parts = [torch.empty_like(logits) for _ in range(cp_size)]
        dist.all_gather(parts, logits.contiguous())
        logits = torch.cat(parts)
    return logits.reshape(-1, logits.shape[-1]), loss, grads


def main() -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    for name, config in (("dense", tiny_qwen3_5_config), ("moe", tiny_qwen3_5_moe_config)):
        cfg = config(initializer_range=0.08)
        torch.manual_seed(0)
        model = build_model(cfg, freeze_vision=False, experts_impl="sorted")
        batch = row(cfg)
        whole = run(model, batch, 1)
        reference = run(copy.deepcopy(model).double(), batch, 1)  # the float32 error of the whole row itself
        patches: list[int] = []
        model.model.visual.register_forward_pre_hook(lambda _m, args, seen=patches: seen.append(int(args[0].shape[0])))
        apply_context_parallel(model, ContextParallel(dist.group.WORLD, rank, size))
        sharded = run(model, batch, size)
        result = {"whole": whole, "cp": sharded, "float64": reference, "patches": patches, "grid": batch.image_grid_thw}
        torch.save(result, Path(os.environ["CP_OUT"]) / f"{name}-rank{rank}.pt")
    video_case(rank, size)
    dist.destroy_process_group()


def video_case(rank: int, size: int) -> None:
    """The dense model on ``video_row``: whole row, each sample alone, then the row under cp = world size."""
    torch.manual_seed(0)
    model = build_model(tiny_qwen3_5_config(initializer_range=0.08), freeze_vision=False)
    batch, alone = video_row()
    whole = run(model, batch, 1)
    reference = run(copy.deepcopy(model).double(), batch, 1)
    singles = [run(model, b, 1) for b in alone]
    patches: list[int] = []
    model.model.visual.register_forward_pre_hook(lambda _m, args, seen=patches: seen.append(int(args[0].shape[0])))
    apply_context_parallel(model, ContextParallel(dist.group.WORLD, rank, size))
    sharded = run(model, batch, size)
    result = {"whole": whole, "cp": sharded, "float64": reference, "alone": singles, "patches": patches}
    result |= {"seq_lens": batch.seq_lens, "mm_token_type_ids": batch.mm_token_type_ids, "grid": batch.image_grid_thw}
    torch.save(result, Path(os.environ["CP_OUT"]) / f"video-rank{rank}.pt")


if __name__ == "__main__":
    main()
    from vlm_sft.parallel.env import end_process

    end_process(0)  # as the CLI ends a process of a multi-process run: the interpreter's teardown can abort (gloo)
