"""Packing self-check: does a packed forward give each sample what it gets alone, up to its own rounding noise?

``check_packing`` concatenates a few samples into one row with ``seq_lens``, runs the model on the packed row and
on each sample alone, and compares per-sample logits, loss gradients w.r.t. every trainable parameter, and the
outputs of each token-mixing op class (vision tower, short conv, linear attention, full attention, MLP) captured by
forward hooks. A backend that lets a segment see its neighbour shows up as a large error in the op class that leaks.
The packing here is a plain concatenation on purpose: this checks the model, not the data packer.

Calibration. A packed sample never equals the sample alone bit for bit (bf16 above all), so a fixed tolerance on
the delta is a guess: too tight fails runs that leak nothing, too loose passes small leaks. Each sample also runs
through a *reference*: a float64 copy of the model on the pure-torch kernels (SDPA, the torch gated delta rule and
conv, the chunked loss; the fla / flash kernels have no float64 path), autocast off. Against it:

- ``floor`` = |alone - reference|: the sample's own noise at the run's precision and kernels;
- ``leak``  = |packed - reference|: the packed row's error;
- ``ratio`` = leak / floor; the check passes when the logits' and the gradients' ratios are ``<= bound``.

An exact packed row is another rounding of the same computation, so its ratio sits near 1; a row whose segments see each
other lands at 10-200 (``RATIO_BOUND`` gives the measurements). The leak is measured against the reference, not against
the sample alone: |packed - alone| reaches floor + leak with no leak at all, so it would need a bound twice as loose.
The reference is finer than float32 (the GatedDeltaNet core runs in float64 too; the norms and the decay stay float32
inside it, as the model writes them), so a float32 run gets a measured floor too: fp32 gradients of ``A_log`` carry
~1e-3 relative error on a 24-layer model, which no fixed float32 tolerance would have allowed.

- Logits: per sample, max |delta| over its logits; each sample's floor is raised to the row's median floor.
- Gradients: the gradient of *sample i's loss inside the packed row* (the packed row run with the loss on i
  only): a leak is gradient reaching i's loss from another segment. Per parameter, the relative error
  ||g - g_ref|| / ||g_ref|| over all samples. The floor is the larger error of two leak-free layouts: i alone in
  its own row, and i followed by padding up to the packed row's length (the packed pass's shapes and kernel paths,
  so its rounding); each floor is raised to the median floor over parameters; the worst parameter is reported.
- Op classes: per module, max |delta| of its outputs over the samples; the module with the largest ratio per class
  is reported, to say where a leak starts (the verdict rests on logits and gradients).

No floor drops below ``MIN_FLOOR_REL`` times the reference's magnitude (a padding segment's outputs can be 0).

Legend: T = tokens of one sample, L = packed row length, D = hidden size, V = vocab, P = patch rows, N = images.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from vlm_sft.checks.noise_floor import (
    MIN_FLOOR_REL,
    Deviation,
    GradErrors,
    RunningMax,
    max_abs,
    median_raised,
)
from vlm_sft.model.backends import Backends, resolve_backends
from vlm_sft.model.layers import MLP, GatedAttention, GatedDeltaNet, ShortConv
from vlm_sft.model.moe import SparseMoeBlock
from vlm_sft.model.vlm import Qwen3_5VLM
from vlm_sft.parallel.parallelize import VISION_TOWER, text_decoder, vision_tower

logger = logging.getLogger(__name__)

RATIO_BOUND = 4.0
"""Largest leak / floor ratio that passes. Calibrated by ``bench/calibrate_packing_check.py`` (results in
``bench/results/packing_check_calibration.json``): the tiny model, 16 seeds, random rows of 6-9 segments mixing
1-3-token texts, samples with 1-2 images, 20-80-token texts and padding, in CPU bf16 autocast on the pure-torch
kernels. Exact rows: logits 1.00, gradients 1.00-1.09. Rounding changed on purpose, as the CUDA kernels' changes with
the shapes: GatedDeltaNet chunk 16 instead of 64 in the packed row, <= 1.47 and <= 1.10; every Linear output of
packed-length rows scaled by an independent random 1 +- 2^-8 (a bf16 rounding's worth), <= 1.72 and <= 1.94.
Leaks: ``seq_lens`` withheld 95-201 (logits) and 75-126 (gradients); only the attention leaking, about the same;
only the short conv, 21-45 and 27-108; only the GatedDeltaNet state carried across segment starts, 1.0-9.8 and
12-73 (random-init decays forget fast, so that leak is small: the gradients catch it). float32: exact rows
<= 0.99 and <= 1.15, every leak > 600. 24-layer models: exact rows <= 1.6 in both precisions when calibrated; the
CI machine (torch 2.13 CPU) puts a 24-layer float32 exact row at 2.54 (``A_log``'s gradient). 4 sits 1.6x above the
largest exact ratio and 2.9x below the smallest leak."""
REFERENCE_DTYPE = torch.float64
"""Parameter dtype of the reference copy."""

LOGIT_CHUNK = 256
"""Tokens whose logits are compared at a time: a float64 ``[LOGIT_CHUNK, V]`` block is 0.5 GB at Qwen3.5's
vocabulary (248,320), and full logits of a long sample would not fit."""

OP_CLASSES: dict[str, type[nn.Module]] = {
    "conv": ShortConv,
    "linear_attention": GatedDeltaNet,
    "attention": GatedAttention,
    "mlp": MLP,
    "moe": SparseMoeBlock,
}
"""Token-level op classes whose outputs (first dim = tokens) are compared segment by segment (``moe``: the routed
experts plus the shared expert, whose own ``MLP`` is also an ``mlp``)."""

SampleDict = Mapping[str, torch.Tensor | None]
"""One sample: ``input_ids`` [T], ``target_ids`` [T], ``loss_mask`` [T], ``position_ids`` [3, T] (required);
``mm_token_type_ids`` [T], ``pixel_values`` [P, D], ``image_grid_thw`` [N, 3] (optional). CPU tensors: the row and
its metadata are built on the CPU and moved to the model's device as a whole."""

_HIDDEN = "hidden"
"""Recorder key of the text decoder's output (final-normed hidden states), from which the logits are computed."""


@dataclass(frozen=True)
class PackingReport:
    """Outcome of ``check_packing``: per compared quantity, the floor, the leak and their ratio."""

    ok: bool
    """True when the logits' and the gradients' ratios are ``<= bound``."""
    bound: float
    """The ratio bound the check used."""
    compute: str
    """Precision and kernels of the packed and alone passes (the run's)."""
    reference: str
    """Precision and kernels of the reference the floors and leaks are measured against."""
    seq_lens: tuple[int, ...]
    """Segment lengths of the packed row (one per sample, in order)."""
    logits: Deviation
    """Logits (absolute max |delta|) of the sample with the largest ratio."""
    per_sample_ratio: tuple[float, ...]
    """Logits ratio per sample (names the sample that leaks)."""
    grad: Deviation
    """Loss gradients, relative per parameter (||delta|| / ||reference||), the parameter with the largest ratio."""
    max_abs_delta: float
    """max |packed - alone| over every logit: the raw number a fixed tolerance would have judged."""
    ops: dict[str, Deviation] = field(default_factory=dict)
    """Per op class (vision, conv, linear_attention, attention, mlp, moe): the module with the largest ratio.
    Diagnostic: it says where a leak starts; the verdict rests on logits and gradients."""

    def format(self) -> str:
        """A table for logs and the CLI: floor, leak and ratio per op class, logits and gradients, then the verdict."""
        rows = [
            f"packing check: {self.compute} vs a reference in {self.reference}; passes when leak / floor <= "
            f"{self.bound:g}",
            f"{'check':<18}{'floor':>12}{'leak':>12}{'ratio':>12}   worst",
        ]
        named = [*self.ops.items(), ("logits", self.logits), ("grad (relative)", self.grad)]
        rows += [f"{n:<18}{d.floor:>12.3e}{d.leak:>12.3e}{_ratio(d.ratio):>12}   {d.where}" for n, d in named]
        verdict = "OK" if self.ok else "FAILED"
        rows.append(
            f"segments {list(self.seq_lens)}: {verdict} (logits ratio {_ratio(self.logits.ratio)}, grad ratio "
            f"{_ratio(self.grad.ratio)}, bound {self.bound:g}; max |packed - alone| logit {self.max_abs_delta:.3e})"
        )
        return "\n".join(rows)

    def to_dict(self) -> dict:
        """Plain JSON-ready values (the trainer writes them to ``<output_dir>/packing_check.json``)."""
        return dataclasses.asdict(self)


def _ratio(r: float) -> str:
    return f"{r:.2f}" if r < 1e4 else f"{r:.2e}"


def exact_backends(device: torch.device | str) -> Backends:
    """The pure-torch kernels, which compute in the dtype they are given (the reference's backends)."""
    return resolve_backends(
        device, attn_impl="sdpa", linear_attn_impl="torch", loss_impl="chunked", experts_impl="sorted"
    )


def reference_model(vlm: Qwen3_5VLM) -> Qwen3_5VLM:
    """A ``REFERENCE_DTYPE`` copy of ``vlm`` on the exact kernels; ``vlm`` itself is left untouched.

    Each floating parameter and buffer is copied straight into the reference dtype (no float32 copy first), tied
    weights stay tied. Costs twice the float32 parameters' memory while the check runs.
    """
    memo: dict[int, object] = {}
    for p in vlm.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to(REFERENCE_DTYPE), requires_grad=p.requires_grad)
    for b in vlm.buffers():
        memo[id(b)] = b.detach().to(REFERENCE_DTYPE) if b.is_floating_point() else b.detach().clone()
    ref = copy.deepcopy(vlm, memo)
    ref.backends = exact_backends(next(vlm.parameters()).device)
    return ref


@dataclass(frozen=True)
class _Row:
    """Model inputs of one row (batch size 1) on the device, and where each sample's tokens and features sit."""

    kwargs: dict[str, torch.Tensor | tuple[int, ...] | None]
    spans: tuple[tuple[int, int], ...]
    """(start, length) of each sample's tokens in the row."""
    feature_spans: tuple[tuple[int, int], ...]
    """(start, count) of each sample's image features in the vision tower's output."""
    loss_mask: torch.Tensor
    """``[L]`` bool on the CPU: the row's loss mask, from which each sample's own mask is cut."""

    @property
    def total(self) -> int:
        return int(self.loss_mask.shape[0])

    def has_loss(self, i: int) -> bool:
        start, n = self.spans[i]
        return bool(self.loss_mask[start : start + n].any())

    def only(self, i: int) -> dict:
        """The row's inputs with the loss restricted to sample ``i`` (its gradient inside the packed row)."""
        start, n = self.spans[i]
        mask = torch.zeros_like(self.loss_mask)
        mask[start : start + n] = self.loss_mask[start : start + n]
        return {**self.kwargs, "loss_mask": mask[None].to(self.kwargs["input_ids"].device)}


def _sample_inputs(s: SampleDict, i: int) -> dict[str, torch.Tensor | None]:
    for key in ("input_ids", "target_ids", "loss_mask", "position_ids"):
        if s.get(key) is None:
            hint = "build them on the CPU with sample_position_ids" if key == "position_ids" else "needed for gradients"
            raise ValueError(f"sample {i}: missing {key!r} ({hint})")
    if (s.get("pixel_values") is None) != (s.get("image_grid_thw") is None):
        raise ValueError(f"sample {i}: pixel_values and image_grid_thw must be given together")
    out = {k: None if s.get(k) is None else s[k].cpu() for k in ("pixel_values", "image_grid_thw")}
    mm = s.get("mm_token_type_ids")
    return {
        **out,
        "input_ids": s["input_ids"].cpu(),
        "position_ids": s["position_ids"].cpu(),
        "mm_token_type_ids": torch.zeros(s["input_ids"].shape[0], dtype=torch.long) if mm is None else mm.cpu(),
        "target_ids": s["target_ids"].cpu(),
        "loss_mask": s["loss_mask"].cpu().bool(),
    }


def _as_row(parts: Sequence[dict], with_seq_lens: bool, device: torch.device) -> _Row:
    """Concatenates samples into one row on the CPU (metadata included), then moves the tensors to ``device``."""
    images = [p for p in parts if p["pixel_values"] is not None]
    lengths = [int(p["input_ids"].shape[0]) for p in parts]
    n_features = [int((p["mm_token_type_ids"] == 1).sum()) for p in parts]
    loss_mask = torch.cat([p["loss_mask"] for p in parts])
    kwargs = {
        "input_ids": torch.cat([p["input_ids"] for p in parts])[None],
        "position_ids": torch.cat([p["position_ids"] for p in parts], dim=1)[:, None],
        "mm_token_type_ids": torch.cat([p["mm_token_type_ids"] for p in parts])[None],
        "target_ids": torch.cat([p["target_ids"] for p in parts])[None],
        "loss_mask": loss_mask[None],
        "pixel_values": torch.cat([p["pixel_values"] for p in images]) if images else None,
        "image_grid_thw": torch.cat([p["image_grid_thw"] for p in images]) if images else None,
    }
    kwargs = {k: None if v is None else v.to(device) for k, v in kwargs.items()}
    kwargs["seq_lens"] = tuple(lengths) if with_seq_lens else None  # host ints: the model never reads the device
    starts = [sum(lengths[:i]) for i in range(len(parts))]
    feature_starts = [sum(n_features[:i]) for i in range(len(parts))]
    spans = tuple(zip(starts, lengths, strict=True))
    return _Row(kwargs, spans, tuple(zip(feature_starts, n_features, strict=True)), loss_mask)


class _OpRecorder:
    """Forward hooks that keep each op-class module's output of the latest forward (detached), and the decoder's."""

    def __init__(self, vlm: Qwen3_5VLM) -> None:
        self.outputs: dict[str, torch.Tensor] = {}
        self._handles = [text_decoder(vlm).register_forward_hook(self._hook(_HIDDEN))]
        self._handles.append(vision_tower(vlm).register_forward_hook(self._hook(f"vision|{VISION_TOWER}")))
        for name, module in vlm.named_modules():
            for op, cls in OP_CLASSES.items():
                if isinstance(module, cls):
                    self._handles.append(module.register_forward_hook(self._hook(f"{op}|{name}")))

    def _hook(self, key: str):
        def hook(_module: nn.Module, _args, output) -> None:
            if isinstance(output, tuple):  # (y, router logits) of an MoE block; (hidden, logits) of the decoder
                output = output[0]
            self.outputs[key] = getattr(output, "pooler_output", output).detach()

        return hook

    def take(self) -> dict[str, torch.Tensor]:
        out, self.outputs = self.outputs, {}
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@dataclass
class _Pass:
    """One forward (+ backward) of a row: op outputs (``_HIDDEN`` included) and parameter gradients."""

    vlm: Qwen3_5VLM
    """The model that ran it (the checked one or the reference), whose LM head gives its logits."""
    ops: dict[str, torch.Tensor]
    grads: list[torch.Tensor] | None
    """None when the pass had no loss token (its gradients are all zero in every layout)."""
    autocast: torch.dtype | None
    """Autocast dtype of the pass (None: off), reused to compute its logits."""

    @torch.no_grad()
    def logits(self, start: int, n: int) -> torch.Tensor:
        """``[n, V]`` logits of tokens ``start:start + n``, computed as the model's forward computes them."""
        hidden = self.ops[_HIDDEN][start : start + n]
        with torch.autocast(hidden.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            return self.vlm.lm_head(hidden)


def _run(model: nn.Module, vlm: Qwen3_5VLM, recorder: _OpRecorder, kwargs: dict, params: list, dtype, backward):
    """Forward with targets (the op hooks record every output, the decoder's hidden states included) under autocast
    to ``dtype`` (None: explicitly off, so a caller's autocast cannot reach the reference), then the gradient of the
    loss sum w.r.t. ``params`` when ``backward``."""
    with torch.autocast(kwargs["input_ids"].device.type, dtype=dtype, enabled=dtype is not None):
        loss_sum, _ = model(**kwargs)
    grads = None
    if backward and params and loss_sum.requires_grad:
        raw = torch.autograd.grad(loss_sum, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, raw, strict=True)]
    return _Pass(vlm, recorder.take(), grads, dtype)


@dataclass
class _Collected:
    """What the passes leave for the report: the packed row, its first pass's outputs and the running errors."""

    row: _Row
    packed: _Pass
    grads: GradErrors
    ops: RunningMax = field(default_factory=RunningMax)
    logits: RunningMax = field(default_factory=RunningMax)
    max_abs_delta: float = 0.0

    def compare(self, i: int, alone: _Pass, reference: _Pass) -> None:
        """Adds sample ``i``'s op outputs and logits (``LOGIT_CHUNK`` tokens at a time) to the running maxima."""
        start, n = self.row.spans[i]
        feature_start, n_features = self.row.feature_spans[i]
        for key, packed_out in self.packed.ops.items():
            s, m = (feature_start, n_features) if key.startswith("vision|") else (start, n)
            if key != _HIDDEN and m:
                self.ops.add(key, packed_out[s : s + m], alone.ops[key], reference.ops[key])
        for c in range(0, n, LOGIT_CHUNK):
            m = min(LOGIT_CHUNK, n - c)
            packed, own = self.packed.logits(start + c, m), alone.logits(c, m)
            self.logits.add(f"sample {i}", packed, own, reference.logits(c, m))
            self.max_abs_delta = max(self.max_abs_delta, max_abs(packed, own))


def check_packing(
    model: nn.Module,
    samples: Sequence[SampleDict],
    *,
    compute_dtype: torch.dtype | None = None,
    bound: float = RATIO_BOUND,
) -> PackingReport:
    """Packs ``samples`` into one row and compares it against each sample alone, calibrated by a float64 reference.

    ``model`` is an unsharded ``Qwen3_5VLM`` with float32 parameters (or a module wrapping one with the same
    forward); frozen ones may be stored in ``compute_dtype``, as a bf16 LoRA run keeps its base. ``compute_dtype``
    (e.g. ``torch.bfloat16``) runs the packed and alone passes under that autocast, as training does. Cost per
    sample: the sample alone and its float64 reference (forward + backward each), and for a sample with loss tokens
    two rows of the packed length (packed, and the sample padded; forward + backward each); per row, one forward of the
    packed row. Memory: a float64 copy of the parameters, and while a sample is compared its float64 reference
    gradients and one float32 set (``GradErrors``). Gradients are taken with ``torch.autograd.grad``: the model's
    ``.grad`` fields are left untouched.
    """
    if not samples:
        raise ValueError("check_packing needs at least one sample")
    vlm = next((m for m in model.modules() if isinstance(m, Qwen3_5VLM)), None)
    if vlm is None:
        raise TypeError(f"check_packing needs a Qwen3_5VLM (or a module holding one), got {type(model).__name__}")
    # Trainable parameters are fp32 master weights; a frozen base may be stored in the compute dtype (bf16 LoRA).
    odd = sorted(
        {
            str(p.dtype)
            for p in vlm.parameters()
            if p.is_floating_point() and p.dtype != torch.float32 and (p.requires_grad or p.dtype != compute_dtype)
        }
    )
    if odd:
        raise ValueError(
            f"check_packing needs float32 parameters (master weights; frozen ones may be in compute_dtype), got "
            f"{odd}: build the model in float32 and pass compute_dtype=torch.bfloat16 to check bf16 compute"
        )
    parts = [_sample_inputs(s, i) for i, s in enumerate(samples)]
    reference = reference_model(vlm)
    recorders = (_OpRecorder(vlm), _OpRecorder(reference))
    try:
        got = _collect(model, vlm, reference, recorders, parts, compute_dtype)
    finally:
        for recorder in recorders:
            recorder.remove()
    report = _report(vlm, reference, got, compute_dtype, bound)
    logger.debug("packing check:\n%s", report.format())  # the caller logs the verdict (one line per run, not per row)
    return report


def _padding_part(n: int, pad_id: int) -> dict[str, torch.Tensor | None]:
    """A padding segment (positions from 0, no loss), to give a sample alone the packed row's length."""
    return {
        "input_ids": torch.full((n,), pad_id, dtype=torch.long),
        "position_ids": torch.arange(n).expand(3, n),
        "mm_token_type_ids": torch.zeros(n, dtype=torch.long),
        "target_ids": torch.full((n,), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros(n, dtype=torch.bool),
        "pixel_values": None,
        "image_grid_thw": None,
    }


def _collect(model, vlm, reference, recorders, parts, compute_dtype) -> _Collected:
    """Per sample ``i``, compared as they come (the reference's gradients and one layout's alive at a time):

    - the reference pass of ``i`` alone;
    - ``i`` alone in its own row: the floor of its logits and op outputs, and one floor of its gradients;
    - ``i`` followed by a padding segment up to the packed row's length, loss on ``i``: the other gradient floor.
      It has the packed pass's shapes and kernel paths, hence its rounding (a single-segment row takes other code
      paths, whose float32 error on ``A_log``'s gradient measured up to 7x smaller on a 24-layer model); what
      follows ``i`` cannot reach it in a causal model;
    - the packed row with the loss on ``i`` only.

    A first forward of the packed row (no backward) gives the row's op outputs and hidden states, from which the
    packed logits are computed chunk by chunk.
    """
    device = next(vlm.parameters()).device
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    vlm_names = {id(p): n for n, p in vlm.named_parameters()}
    ref_params = [dict(reference.named_parameters())[vlm_names[id(p)]] for p in params]
    pad_id = int(vlm.config.text_config.pad_token_id or 0)
    recorder, ref_recorder = recorders
    row = _as_row(parts, True, device)
    first = _run(model, vlm, recorder, row.only(0), params, compute_dtype, False)
    got = _Collected(row, first, GradErrors([n for n, _ in named]))
    for i, part in enumerate(parts):
        alone_row = _as_row([part], False, device)
        backward = row.has_loss(i)
        ref = _run(reference, reference, ref_recorder, alone_row.kwargs, ref_params, None, backward)
        alone = _run(model, vlm, recorder, alone_row.kwargs, params, compute_dtype, backward)
        got.compare(i, alone, ref)
        if not backward:
            continue
        got.grads.add_reference(ref.grads)
        got.grads.add("alone", alone.grads, ref.grads)
        alone.grads = None  # freed before the next pass: one float32 set at a time
        fill = row.total - row.spans[i][1]
        padded_row = _as_row([part, _padding_part(fill, pad_id)] if fill else [part], True, device)
        got.grads.add(
            "padded", _run(model, vlm, recorder, padded_row.only(0), params, compute_dtype, True).grads, ref.grads
        )
        got.grads.add("packed", _run(model, vlm, recorder, row.only(i), params, compute_dtype, True).grads, ref.grads)
    return got


def _describe(backends: Backends, precision: str) -> str:
    kernels = ", ".join(f"{f.name}={getattr(backends, f.name)}" for f in dataclasses.fields(backends))
    return f"{precision} ({kernels})"


def _report(vlm, reference, got: _Collected, compute_dtype, bound: float) -> PackingReport:
    """Turns the running maxima into the report."""
    per_sample = median_raised(got.logits)
    worst_logits = max(per_sample.values(), key=lambda d: d.ratio)
    grad = got.grads.deviation()
    precision = "float32" if compute_dtype is None else f"{str(compute_dtype).removeprefix('torch.')} autocast"
    return PackingReport(
        ok=worst_logits.ratio <= bound and grad.ratio <= bound,
        bound=bound,
        compute=_describe(vlm.backends, precision),
        reference=_describe(reference.backends, str(REFERENCE_DTYPE).removeprefix("torch.")),
        seq_lens=tuple(n for _, n in got.row.spans),
        logits=worst_logits,
        per_sample_ratio=tuple(d.ratio for d in per_sample.values()),
        grad=grad,
        max_abs_delta=got.max_abs_delta,
        ops=_ops_by_class(got.ops.deviations()),
    )


def _ops_by_class(devs: dict[str, Deviation]) -> dict[str, Deviation]:
    """The module with the largest ratio per op class, named by its module path."""
    out: dict[str, Deviation] = {}
    for key, dev in devs.items():
        op, name = key.split("|", 1)
        if op not in out or dev.ratio > out[op].ratio:
            out[op] = dataclasses.replace(dev, where=name)
    return {op: out[op] for op in ["vision", *OP_CLASSES] if op in out}


__all__ = [
    "MIN_FLOOR_REL",
    "OP_CLASSES",
    "RATIO_BOUND",
    "REFERENCE_DTYPE",
    "Deviation",
    "PackingReport",
    "SampleDict",
    "check_packing",
    "exact_backends",
    "reference_model",
]
