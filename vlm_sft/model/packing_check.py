"""Packing self-check: does a packed forward give each sample exactly what it gets alone?

``check_packing`` concatenates a few samples into one row with ``seq_lens``, runs the model on the packed row and
on each sample alone, and compares per-sample logits, the loss gradient w.r.t. every trainable parameter, and the
outputs of each token-mixing op class (vision tower, short conv, linear attention, full attention, MLP) captured
by forward hooks. A backend that lets a segment see its neighbour shows up as a large delta in the op class that
leaks. The packing here is a plain concatenation on purpose: this checks the model, not the data packer.

Legend: T = tokens of one sample, L = packed row length, V = vocab, P = patch rows, N = images.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from vlm_sft.model.layers import MLP, GatedAttention, GatedDeltaNet, ShortConv
from vlm_sft.model.vlm import Qwen3_5VLM

logger = logging.getLogger(__name__)

OP_CLASSES: dict[str, type[nn.Module]] = {
    "conv": ShortConv,
    "linear_attention": GatedDeltaNet,
    "attention": GatedAttention,
    "mlp": MLP,
}
"""Token-level op classes whose outputs (first dim = tokens) are compared segment by segment."""

SampleDict = Mapping[str, torch.Tensor | None]
"""One sample: ``input_ids`` [T], ``target_ids`` [T], ``loss_mask`` [T], ``position_ids`` [3, T] (required);
``mm_token_type_ids`` [T], ``pixel_values`` [P, D], ``image_grid_thw`` [N, 3] (optional)."""


@dataclass(frozen=True)
class PackingReport:
    """Outcome of ``check_packing``: worst deltas between the packed row and the samples run alone."""

    ok: bool
    """True when the logit and gradient deltas are within tolerance."""
    tol: float
    """Tolerance on the max absolute logit delta."""
    grad_tol: float
    """Tolerance on the max relative gradient delta (per parameter: max |delta| / max |grad alone|)."""
    seq_lens: tuple[int, ...]
    """Segment lengths of the packed row (one per sample, in order)."""
    logits_delta: float
    """Max |packed - alone| over every logit of every sample."""
    per_sample_logits_delta: tuple[float, ...]
    """The same, per sample (names the sample that leaks)."""
    grad_rel_delta: float
    """Max over trainable parameters of max |grad packed - grad alone| / max |grad alone|."""
    worst_grad_param: str
    """Name of the parameter with the largest relative gradient delta."""
    op_deltas: dict[str, float] = field(default_factory=dict)
    """Max |packed - alone| of each op class's outputs: vision (features), conv, linear_attention, attention, mlp."""

    def format(self) -> str:
        """A small table for logs and the CLI."""
        rows = [f"{'check':<18}{'max |delta|':>14}"]
        rows += [f"{name:<18}{delta:>14.3e}" for name, delta in self.op_deltas.items()]
        rows.append(f"{'logits':<18}{self.logits_delta:>14.3e}   (tol {self.tol:.1e})")
        rows.append(
            f"{'grad (relative)':<18}{self.grad_rel_delta:>14.3e}   (tol {self.grad_tol:.1e}; {self.worst_grad_param})"
        )
        rows.append(f"segments {list(self.seq_lens)}: {'OK' if self.ok else 'FAILED'}")
        return "\n".join(rows)


@dataclass(frozen=True)
class _Batch:
    """Model inputs of one row (batch size 1)."""

    kwargs: dict[str, torch.Tensor | None]
    n_features: tuple[int, ...]
    """Image features (slots) per sample, to split the vision tower's output."""


def _sample_inputs(model: Qwen3_5VLM, s: SampleDict, i: int) -> dict[str, torch.Tensor | None]:
    for key in ("input_ids", "target_ids", "loss_mask"):
        if s.get(key) is None:
            raise ValueError(f"sample {i}: missing {key!r} (check_packing needs targets to compare gradients)")
    ids = s["input_ids"]
    T = ids.shape[0]
    mm = s.get("mm_token_type_ids")
    mm = torch.zeros(T, dtype=torch.long, device=ids.device) if mm is None else mm
    pos = s.get("position_ids")
    if pos is None:
        raise ValueError(f"sample {i}: missing 'position_ids' (build them on the CPU with sample_position_ids)")
    if (s.get("pixel_values") is None) != (s.get("image_grid_thw") is None):
        raise ValueError(f"sample {i}: pixel_values and image_grid_thw must be given together")
    return {
        "input_ids": ids,
        "position_ids": pos,
        "mm_token_type_ids": mm,
        "target_ids": s["target_ids"],
        "loss_mask": s["loss_mask"].bool(),
        "pixel_values": s.get("pixel_values"),
        "image_grid_thw": s.get("image_grid_thw"),
    }


def _as_row(parts: Sequence[dict[str, torch.Tensor | None]], seq_lens: torch.Tensor | None) -> _Batch:
    """Concatenates samples into one row (one sample: the sample alone, without seq_lens)."""
    images = [p for p in parts if p["pixel_values"] is not None]
    kwargs: dict[str, torch.Tensor | None] = {
        "input_ids": torch.cat([p["input_ids"] for p in parts])[None],
        "position_ids": torch.cat([p["position_ids"] for p in parts], dim=1)[:, None],
        "mm_token_type_ids": torch.cat([p["mm_token_type_ids"] for p in parts])[None],
        "target_ids": torch.cat([p["target_ids"] for p in parts])[None],
        "loss_mask": torch.cat([p["loss_mask"] for p in parts])[None],
        "pixel_values": torch.cat([p["pixel_values"] for p in images]) if images else None,
        "image_grid_thw": torch.cat([p["image_grid_thw"] for p in images]) if images else None,
        "seq_lens": seq_lens,
    }
    n_features = tuple(int((p["mm_token_type_ids"] == 1).sum()) for p in parts)
    return _Batch(kwargs, n_features)


class _OpRecorder:
    """Forward hooks that store each op-class module's output of the latest forward (detached)."""

    def __init__(self, model: nn.Module) -> None:
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self._handles = []
        visual = next(m.model.visual for m in model.modules() if isinstance(m, Qwen3_5VLM))
        for name, module in model.named_modules():
            for op, cls in OP_CLASSES.items():
                if isinstance(module, cls):
                    self._handles.append(module.register_forward_hook(self._hook(op, name)))
            if module is visual:
                self._handles.append(module.register_forward_hook(self._hook("vision", name)))

    def _hook(self, op: str, name: str):
        def hook(_module: nn.Module, _args, output) -> None:
            out = getattr(output, "pooler_output", output)
            self.outputs[f"{op}|{name}"] = out.detach().float()

        return hook

    def take(self) -> dict[str, torch.Tensor]:
        out, self.outputs = self.outputs, {}
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _forward(model: nn.Module, batch: _Batch, params: list[nn.Parameter]):
    """Logits (no grad) and the loss gradient of one row."""
    kw = dict(batch.kwargs)
    target_ids, loss_mask = kw.pop("target_ids"), kw.pop("loss_mask")
    with torch.no_grad():
        logits = model(**kw).float()
    loss_sum, _ = model(**kw, target_ids=target_ids, loss_mask=loss_mask)
    grads = torch.autograd.grad(loss_sum, params, allow_unused=True) if loss_sum.requires_grad else [None] * len(params)
    return logits[0], [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads, strict=True)]


def check_packing(
    model: nn.Module, samples: Sequence[SampleDict], *, tol: float, grad_tol: float | None = None
) -> PackingReport:
    """Packs ``samples`` into one row and compares it against each sample alone; see the module docstring.

    ``model`` is a ``Qwen3_5VLM`` (or a module wrapping one with the same forward). Gradients are taken with
    ``torch.autograd.grad``, so the model's ``.grad`` fields are left untouched. ``grad_tol`` defaults to ``tol``.
    """
    if not samples:
        raise ValueError("check_packing needs at least one sample")
    grad_tol = tol if grad_tol is None else grad_tol
    vlm = next((m for m in model.modules() if isinstance(m, Qwen3_5VLM)), None)
    if vlm is None:
        raise TypeError(f"check_packing needs a Qwen3_5VLM (or a module holding one), got {type(model).__name__}")
    parts = [_sample_inputs(vlm, s, i) for i, s in enumerate(samples)]
    lengths = [int(p["input_ids"].shape[0]) for p in parts]
    params_named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in params_named]

    recorder = _OpRecorder(model)
    try:
        packed = _as_row(parts, tuple(lengths))
        packed_logits, packed_grads = _forward(model, packed, params)
        packed_ops = recorder.take()  # the grad forward's outputs equal the logits forward's
        alone = []
        for part in parts:
            logits, grads = _forward(model, _as_row([part], None), params)
            alone.append((logits, grads, recorder.take()))
    finally:
        recorder.remove()

    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    per_sample = []
    for (logits, _, _), start, n in zip(alone, starts, lengths, strict=True):
        per_sample.append(float((packed_logits[start : start + n] - logits).abs().max()))

    op_deltas: dict[str, float] = {}
    for key, packed_out in packed_ops.items():
        op = key.split("|", 1)[0]
        worst = op_deltas.get(op, 0.0)
        if op == "vision":
            feat_starts = [sum(packed.n_features[:i]) for i in range(len(parts))]
            for (_, _, ops), fs, nf in zip(alone, feat_starts, packed.n_features, strict=True):
                if nf:
                    worst = max(worst, float((packed_out[fs : fs + nf] - ops[key]).abs().max()))
        else:
            for (_, _, ops), start, n in zip(alone, starts, lengths, strict=True):
                worst = max(worst, float((packed_out[start : start + n] - ops[key]).abs().max()))
        op_deltas[op] = worst

    grad_rel, worst_name = 0.0, ""
    for j, (name, _) in enumerate(params_named):
        ref = sum(a[1][j] for a in alone)
        denom = float(ref.abs().max())
        diff = float((packed_grads[j] - ref).abs().max())
        rel = diff / denom if denom > 0 else diff
        if rel > grad_rel or not worst_name:
            grad_rel, worst_name = rel, name
    logits_delta = max(per_sample)
    report = PackingReport(
        ok=logits_delta <= tol and grad_rel <= grad_tol,
        tol=tol,
        grad_tol=grad_tol,
        seq_lens=tuple(lengths),
        logits_delta=logits_delta,
        per_sample_logits_delta=tuple(per_sample),
        grad_rel_delta=grad_rel,
        worst_grad_param=worst_name,
        op_deltas=op_deltas,
    )
    (logger.info if report.ok else logger.warning)("packing check:\n%s", report.format())
    return report
