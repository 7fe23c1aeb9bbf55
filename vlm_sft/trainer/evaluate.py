"""Held-out eval: loss per trainable token, and answer accuracy by teacher-forced argmax.

A sample counts as answered when the argmax prediction equals the target at every trainable position of its
assistant reply (teacher forcing: no generation loop). On shapes the replies are templated ("The shape is red."),
so once the template is learned the accuracy of colour questions measures whether image features reach the
language model: the text alone carries no colour (chance 1/6).

Eval batches are packed rows like training ones; the model keeps samples apart through ``seq_lens``, so packing
does not change any sample's prediction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from vlm_sft.data.batch import PackedBatch
from vlm_sft.trainer.distributed import DistEnv, all_reduce, all_reduce_sum


def model_inputs(batch: PackedBatch) -> dict:
    """The keyword arguments of ``Qwen3_5VLM.forward`` for one batch (targets excluded)."""
    return {
        "seq_lens": batch.seq_lens,
        "position_ids": batch.position_ids,
        "pixel_values": batch.pixel_values,
        "image_grid_thw": batch.image_grid_thw,
        "mm_token_type_ids": batch.mm_token_type_ids,
    }


def _row_segments(batch: PackedBatch) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) token spans of its samples, in order; padding segments excluded."""
    B, L = batch.input_ids.shape
    if batch.seq_lens is None:
        spans = []
        for r in range(B):
            real = int(batch.attention_mask[r].sum()) if batch.attention_mask is not None else L
            spans.append([(0, real)] if batch.sample_indices[r] else [])
        return spans
    lens = batch.seq_lens.tolist()
    out: list[list[tuple[int, int]]] = []
    pos = 0
    for r in range(B):
        row, start, n_samples = [], 0, len(batch.sample_indices[r])
        while start < L:
            n = lens[pos]
            pos += 1
            if len(row) < n_samples:
                row.append((start, start + n))
            start += n
        out.append(row)
    return out


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Sequence[PackedBatch],
    *,
    env: DistEnv,
    sample_tasks: dict[int, str] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Eval loss and per-task accuracy over ``batches`` (this rank's share), reduced over all ranks.

    Every rank runs the same number of forwards (FSDP issues collectives in each one): a rank with fewer batches
    repeats its last one and ignores the result.
    """
    was_training = model.training
    model.eval()
    n_local = torch.tensor(len(batches), dtype=torch.long)
    n_forwards = int(all_reduce(n_local, env, "max"))
    sums = torch.zeros(2, dtype=torch.float64)  # loss sum, token count
    correct: Counter[str] = Counter()
    seen: Counter[str] = Counter()
    tasks = sample_tasks or {}
    for i in range(n_forwards):
        if not batches:
            raise RuntimeError(f"rank {env.rank} has no eval batch; use at least as many eval packs as ranks")
        batch = batches[min(i, len(batches) - 1)].to(env.device)
        with torch.autocast(env.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(batch.input_ids, **model_inputs(batch))
        if i >= len(batches):
            continue
        logits = logits.float()
        mask = batch.loss_mask
        nll = nn.functional.cross_entropy(logits[mask], batch.target_ids[mask], reduction="sum")
        sums += torch.tensor([float(nll), float(mask.sum())], dtype=torch.float64)
        hit = (logits.argmax(-1) == batch.target_ids) | ~mask
        for r, spans in enumerate(_row_segments(batch)):
            for (start, end), idx in zip(spans, batch.sample_indices[r], strict=True):
                if not bool(mask[r, start:end].any()):
                    continue
                task = tasks.get(int(idx), "all")
                ok = bool(hit[r, start:end].all())
                for key in {task, "all"}:
                    seen[key] += 1
                    correct[key] += int(ok)
    keys = sorted(set(tasks.values()) | {"all"})
    counts = torch.tensor([[correct[k], seen[k]] for k in keys], dtype=torch.float64)
    sums = all_reduce_sum(sums, env)
    counts = all_reduce_sum(counts, env)
    model.train(was_training)
    out = {"eval_loss": float(sums[0] / sums[1].clamp(min=1)), "eval_tokens": int(sums[1])}
    for k, (c, s) in zip(keys, counts.tolist(), strict=True):
        if s:
            out[f"eval_acc_{k}"] = c / s
    return out
