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
            kwargs = batch.model_kwargs()
            del kwargs["target_ids"], kwargs["loss_mask"]  # no targets: the model returns logits
            logits = model(**kwargs)
        if i >= len(batches):
            continue
        logits = logits.float()
        mask = batch.loss_mask
        nll = nn.functional.cross_entropy(logits[mask], batch.target_ids[mask], reduction="sum")
        sums += torch.tensor([float(nll), float(mask.sum())], dtype=torch.float64)
        hit = (logits.argmax(-1) == batch.target_ids) | ~mask
        for r in range(batch.shape[0]):
            for start, end, idx in batch.row_segments(r):
                if idx is None or not bool(mask[r, start:end].any()):  # padding, or nothing trained
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
