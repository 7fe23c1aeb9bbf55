"""Held-out eval: loss per trainable token, and answer accuracy by teacher-forced argmax, reduced over ranks.

A sample counts as answered when the argmax prediction equals the target at every trainable position of its
assistant reply (teacher forcing: no generation loop). On shapes the replies are templated ("The shape is red."),
so once the template is learned the accuracy of colour questions measures whether image features reach the
language model: the text alone carries no colour (chance 1/6).

Eval batches are packed rows like training ones; the model keeps samples apart through ``seq_lens``, so packing
does not change any sample's prediction. Scoring is ``vlm_sft.trainer.scoring.score_batch`` (chunked: never the
``[B, L, V]`` logits, so eval fits the training loss's memory budget); this module adds the per-task tallies and
the cross-rank reduction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from vlm_sft.config import RunConfig
from vlm_sft.data import build as data_build
from vlm_sft.data.batch import PackedBatch
from vlm_sft.data.collate import collate
from vlm_sft.parallel.collectives import all_reduce
from vlm_sft.parallel.env import DistEnv
from vlm_sft.trainer.scoring import BatchScores, filler_batch, score_batch


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Sequence[PackedBatch],
    *,
    env: DistEnv,
    sample_tasks: dict[int, str] | None = None,
    sample_groups: dict[int, str] | None = None,
) -> dict[str, float]:
    """Eval loss and per-task accuracy over ``batches`` (this rank's share, CPU batches), reduced over all ranks.

    Returns ``eval_loss`` (loss sum / trainable tokens), ``eval_tokens``, and ``eval_acc_<task>`` for every task of
    ``sample_tasks`` (dataset index -> task) that has a scored sample, plus ``eval_acc_all``. With ``sample_groups``
    (dataset index -> held-out source name) also ``eval_loss/<name>`` for every source with a trainable token and
    ``eval_acc/<name>`` for every source with a scored sample. Both maps must be the same on every rank (the whole
    held-out split's): their names fix the layout of the reduced tallies.

    Every rank runs the same number of forwards (FSDP all-gathers parameters in each one): a rank with fewer batches
    than its peers, or none at all, scores a tiny filler batch instead, which contributes nothing. Collectives: one
    ``max`` of the batch counts before, one ``sum`` of all tallies after, on CPU tensors.
    """
    tasks, groups = sample_tasks or {}, sample_groups or {}
    keys = sorted(set(tasks.values()) | {"all"})  # the same on every rank: the tally tensor has one layout
    names = sorted(set(groups.values()))
    n_forwards = int(all_reduce(torch.tensor([len(batches)]), env, "max"))
    sums = torch.zeros(2, dtype=torch.float64)  # loss sum, trainable tokens
    per_group = torch.zeros(len(names), len(GROUP_TALLY), dtype=torch.float64)
    correct: Counter[str] = Counter()
    seen: Counter[str] = Counter()
    was_training = model.training
    model.eval()
    try:
        for i in range(n_forwards):
            if i >= len(batches):
                score_batch(model, filler_batch(), env.device)
                continue
            scored = score_batch(model, batches[i], env.device)
            sums += torch.tensor([scored.loss_sum, scored.num_tokens], dtype=torch.float64)
            for sample in scored.samples:
                for key in {tasks.get(sample.index, "all"), "all"}:
                    seen[key] += 1
                    correct[key] += int(sample.answered)
            if names:
                _tally_groups(per_group, scored, batches[i].loss_mask, groups, names)
    finally:
        model.train(was_training)
    counts = torch.tensor([[correct[k], seen[k]] for k in keys], dtype=torch.float64)
    total = all_reduce(torch.cat([sums, counts.flatten(), per_group.flatten()]), env, "sum")
    loss_sum, tokens = float(total[0]), int(total[1])
    counts = total[2 : 2 + 2 * len(keys)].view(-1, 2).tolist()
    out: dict[str, float] = {"eval_loss": loss_sum / max(tokens, 1), "eval_tokens": tokens}
    for key, (c, s) in zip(keys, counts, strict=True):
        if s:
            out[f"eval_acc_{key}"] = c / s
    out.update(_group_metrics(names, total[2 + 2 * len(keys) :].view(len(names), len(GROUP_TALLY))))
    return out


GROUP_TALLY = ("loss_sum", "tokens", "answered", "scored")
"""Columns of the per-source tally (one row per source name, sorted), summed over batches and then over ranks."""
SOURCE_LOSS, SOURCE_ACC = "eval_loss/", "eval_acc/"
"""Prefixes of the per-source keys (``eval_loss/<name>``, ``eval_acc/<name>``); ``/`` groups them in the trackers and
keeps them apart from the per-task ``eval_acc_<task>``."""


def _tally_groups(
    per_group: torch.Tensor, scored: BatchScores, loss_mask: torch.Tensor, groups: dict[int, str], names: list[str]
) -> None:
    """Adds every scored sample of a batch to its source's row of ``per_group`` (``[len(names), 4]``, fp64).

    A sample's loss is ``nll`` summed over its whole span: ``nll`` is 0 off the loss mask, so this is the sum over its
    trainable positions, and samples left out of ``scored.samples`` (padding, nothing trainable) hold none of the
    batch's loss. The sources' sums therefore add up to ``scored.loss_sum`` (both accumulated in fp64).
    """
    row_of = {name: i for i, name in enumerate(names)}
    for s in scored.samples:
        if s.index not in groups:  # built from the same held-out rows: a bug, never the data
            raise KeyError(f"held-out row {s.index} has no source in eval_groups")
        loss = float(scored.nll[s.row, s.start : s.end].sum(dtype=torch.float64))
        tokens = int(loss_mask[s.row, s.start : s.end].sum())
        per_group[row_of[groups[s.index]]] += torch.tensor([loss, tokens, int(s.answered), 1], dtype=torch.float64)


def _group_metrics(names: list[str], per_group: torch.Tensor) -> dict[str, float]:
    """``eval_loss/<name>`` where the source has trainable tokens (a source without any has no loss to report, not a
    loss of 0), ``eval_acc/<name>`` where it has a scored sample; from the reduced tallies."""
    out: dict[str, float] = {}
    for name, (loss_sum, tokens, answered, scored) in zip(names, per_group.tolist(), strict=True):
        if tokens:
            out[SOURCE_LOSS + name] = loss_sum / tokens
        if scored:
            out[SOURCE_ACC + name] = answered / scored
    return out


def build_eval_batches(
    cfg: RunConfig, sources: data_build.DataSources, renderer, env: DistEnv, pad_id: int
) -> list[PackedBatch]:
    """This rank's share of the held-out packs (rows ``rank, rank + world, ...``), packed ``cat`` (``stack`` for a
    padded run), collated on the CPU once for every eval."""
    if sources.eval is None:
        return []
    pipeline = data_build.build_pipeline(
        cfg,
        sources.eval,
        renderer,
        shard=env.rank,
        num_shards=env.world_size,
        epochs=1,
        shuffle=False,
        packing="stack" if cfg.data.packing == "stack" else "cat",
    )
    return [collate([p], pad_id=pad_id) for p in pipeline]


def format_eval(step: int, ev: dict) -> str:
    """The eval line of the log: loss (and per held-out source, where there are several), teacher-forced accuracy per
    task, generated accuracy per task, the benchmark score of each scored source."""
    line = f"step {step}: eval loss {ev['eval_loss']:.4f}"
    kinds = (
        (SOURCE_LOSS, "per source"),
        ("eval_acc_", "accuracy"),
        ("eval_gen_acc_", "generated"),
        ("eval_score/", "score"),
    )
    for prefix, label in kinds:
        values = [f"{k.removeprefix(prefix)}={v:.3f}" for k, v in sorted(ev.items()) if k.startswith(prefix)]
        if values:
            line += f"; {label} {' '.join(values)}"
    return line
