"""Teacher-forced scoring of one packed batch: per-token loss and argmax, and which samples the model answers.

The one implementation behind the trainer's eval (``vlm_sft.trainer.evaluate``) and the notebooks' checkpoint probes
(``vlm_sft.viz.teacher_forced``). The model scores its tokens chunk by chunk (``forward(..., scores=True)``, see
``vlm_sft.model.loss.token_scores``) and never builds ``[B, L, V]`` logits: at Qwen3.5's vocabulary (248,320) the
fp32 logits of a 16k-token batch alone take 16 GB, more than the whole training step's loss budget.

A sample is *answered* when the argmax equals the target at every trainable position of its reply (teacher forcing:
each position sees the reference prefix, no generation loop). Positions outside the loss mask (prompt, image slots,
padding) never count.

Device reads: the per-token losses and argmax come to the CPU once per batch; the per-sample bookkeeping then runs on
the CPU copies and on the CPU batch the collator built, so a batch costs O(1) host syncs whatever its sample count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vlm_sft.data.batch import PackedBatch

FILLER_TOKENS = 4
"""Length of the filler batch: the smallest forward that still runs every layer (and so every FSDP all-gather)."""


@dataclass(frozen=True)
class SampleScore:
    """One sample of a scored batch that has at least one trainable token."""

    index: int
    """Dataset index (from ``PackedBatch.sample_indices``)."""
    row: int
    """Row of the batch the sample sits in."""
    start: int
    """First token of the sample in its row."""
    end: int
    """One past its last token."""
    answered: bool
    """Argmax == target at every trainable position of the sample."""


@dataclass(frozen=True)
class BatchScores:
    """Teacher-forced results of one batch, on the CPU."""

    nll: torch.Tensor
    """fp32 ``[B, L]``: cross-entropy of each target where the loss mask is True, 0 elsewhere."""
    argmax: torch.Tensor
    """int64 ``[B, L]``: the most likely next token at every position."""
    samples: tuple[SampleScore, ...]
    """The samples with a trainable token, in row then pack order (padding and prompt-only samples left out)."""
    loss_sum: float
    """Sum of ``nll`` over the loss mask (accumulated in fp64)."""
    num_tokens: int
    """Trainable tokens of the batch (``loss_mask.sum()``)."""


@torch.no_grad()
def score_batch(model: nn.Module, batch: PackedBatch, device: torch.device) -> BatchScores:
    """Runs ``model`` on ``batch`` (the collator's CPU batch; moved to ``device`` here) and scores it on the CPU.

    One forward in scores mode, then one copy each of the per-token losses and argmax to the host.
    """
    if batch.loss_mask.device.type != "cpu":
        raise ValueError(
            f"score_batch takes the collator's CPU batch (got one on {batch.loss_mask.device}): it moves the batch to "
            "the device itself and keeps the CPU copy for the per-sample bookkeeping"
        )
    on_device = batch.to(device)
    out = model(**on_device.model_kwargs(), scores=True)  # bf16 runs compute in bf16 through FSDP's mixed precision
    nll, argmax = out.nll.cpu(), out.argmax.cpu()
    return BatchScores(
        nll=nll,
        argmax=argmax,
        samples=answered_samples(batch, argmax),
        loss_sum=float(nll.sum(dtype=torch.float64)),
        num_tokens=int(batch.loss_mask.sum()),
    )


def answered_samples(batch: PackedBatch, argmax: torch.Tensor) -> tuple[SampleScore, ...]:
    """Every sample of ``batch`` with a trainable token, and whether ``argmax`` (``[B, L]``, CPU) answers it."""
    mask = batch.loss_mask
    hit = (argmax == batch.target_ids) | ~mask
    out = []
    for row in range(batch.shape[0]):
        for start, end, index in batch.row_segments(row):
            if index is None or not bool(mask[row, start:end].any()):  # padding, or nothing trained
                continue
            out.append(SampleScore(int(index), row, start, end, bool(hit[row, start:end].all())))
    return tuple(out)


def filler_batch(length: int = FILLER_TOKENS) -> PackedBatch:
    """A one-row text batch of padding (token 0) with no sample and no trainable token, built on the CPU.

    A rank with fewer eval batches than its peers scores this instead, so every rank runs the same number of forwards
    (FSDP all-gathers parameters in each one) and issues the same collectives; it contributes nothing.
    """
    zeros = torch.zeros(1, length, dtype=torch.long)
    return PackedBatch(
        input_ids=zeros,
        target_ids=zeros.clone(),
        loss_mask=torch.zeros(1, length, dtype=torch.bool),
        position_ids=torch.arange(length).expand(3, 1, length).clone(),
        seq_lens=torch.tensor([length]),
        pixel_values=None,
        image_grid_thw=None,
        mm_token_type_ids=zeros.clone(),
        num_trainable_tokens=0,
        num_real_tokens=0,
        sample_indices=((),),
    )
