"""Floor, leak and ratio: the bookkeeping of a comparison calibrated by the compared quantity's own noise.

Three computations of the same quantity are compared with a fine reference: one that cannot be wrong in the way
under test (its error is the *floor*: rounding noise of the precision and kernels), one that can (its error is the
*leak*), and their ratio decides. ``vlm_sft.checks.packing_check`` uses it with "the sample alone" and "the sample
packed"; nothing here knows about models. Two guards keep a ratio from dividing by an unlucky small floor: a floor
is raised to the median floor of its peers (samples, parameters), and never drops below ``MIN_FLOOR_REL`` times the
reference's magnitude (a quantity that is exactly 0 in every computation, like a padding segment's outputs).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

MIN_FLOOR_REL = 1e-6
"""Smallest floor, relative to the reference's max |value| (about ten float32 roundings): only a quantity that is
exactly 0 in every pass, such as a padding segment's outputs, falls back on it."""


@dataclass(frozen=True)
class Deviation:
    """One compared quantity: its own noise (floor), the error under test (leak), and their ratio."""

    floor: float
    """Error of the computation that cannot be wrong in the way under test, e.g. |alone - reference| (raised as the
    module docstring says)."""
    leak: float
    """Error of the computation under test, e.g. |packed - reference|."""
    ratio: float
    """leak / floor: ~1 when the computation under test is only another rounding, far above 1 when it is wrong."""
    where: str
    """What gave the worst ratio: a sample (``sample 3``), a module or a parameter name."""


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in the finer of the two dtypes and at least float32 (a float64 reference is not rounded first)."""
    if not a.numel():
        return 0.0
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return float((a.to(dtype) - b.to(dtype)).abs().max())


def deviation(floor: float, leak: float, scale: float, where: str) -> Deviation:
    """A deviation whose floor is raised to ``MIN_FLOOR_REL * scale`` (never 0, so the ratio is always defined)."""
    floor = max(floor, MIN_FLOOR_REL * scale, torch.finfo(torch.float32).tiny)
    return Deviation(floor=floor, leak=leak, ratio=leak / floor, where=where)


@dataclass
class RunningMax:
    """Running maxima per compared key (a module or a sample) over the samples: floor, leak and scale."""

    floor: dict[str, float] = field(default_factory=dict)
    leak: dict[str, float] = field(default_factory=dict)
    scale: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, packed: torch.Tensor, alone: torch.Tensor, reference: torch.Tensor) -> None:
        if reference.numel() == 0:
            return
        for table, value in (
            (self.floor, max_abs(alone, reference)),
            (self.leak, max_abs(packed, reference)),
            (self.scale, float(reference.abs().max())),
        ):
            table[key] = max(table.get(key, 0.0), value)

    def deviations(self) -> dict[str, Deviation]:
        """Per key, each floor raised to ``MIN_FLOOR_REL`` x the key's own magnitude."""
        return {k: deviation(self.floor[k], self.leak[k], self.scale[k], k) for k in self.floor}


class GradErrors:
    """Per parameter, summed over samples: squared norms of the errors of two floor computations (for packing: the
    sample alone in its own row, and alone in a row of the packed length), of the computation under test (packed),
    and of the reference gradient itself.

    Each layout's gradients are added on their own (``add``), so a caller holds the reference's gradients and one
    layout's at a time, never all four sets: for a model of P trainable parameters that is 12 P bytes (a float64
    reference and one float32 set) instead of 20 P."""

    LAYOUTS = ("alone", "padded", "packed")
    """The compared layouts: two floors (``alone``, ``padded``) and the one under test (``packed``)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.sq = {layout: [0.0] * len(names) for layout in self.LAYOUTS}
        self.ref_sq = [0.0] * len(names)

    def add_reference(self, reference: list) -> None:
        """One sample's reference gradients (their norms are the relative errors' denominators)."""
        for j, g_ref in enumerate(reference):
            self.ref_sq[j] += float(torch.linalg.vector_norm(g_ref)) ** 2

    def add(self, layout: str, grads: list, reference: list) -> None:
        """One sample's gradients in ``layout`` (one of ``LAYOUTS``) against its reference gradients."""
        table = self.sq[layout]
        for j, (g, g_ref) in enumerate(zip(grads, reference, strict=True)):
            table[j] += float(torch.linalg.vector_norm(g - g_ref)) ** 2

    def deviation(self) -> Deviation:
        """Relative errors per parameter (norms over all its elements and every sample's gradient: a max would rest
        on one element). A parameter's floor is the larger of its two leak-free layouts' errors, raised to the median
        floor over parameters: ill-conditioned gradients (``A_log``, ``dt_bias``: sums that cancel) scatter by
        several times between two roundings, and a parameter of a few elements would divide by a noisy number."""
        rows = [
            (name, math.sqrt(max(a, p) / r), math.sqrt(lk / r))
            for name, a, p, lk, r in zip(
                self.names, self.sq["alone"], self.sq["padded"], self.sq["packed"], self.ref_sq, strict=True
            )
            if r > 0.0  # no gradient reaches it in any layout (e.g. only padding uses it)
        ]
        if not rows:
            return deviation(0.0, 0.0, 1.0, "(no trainable parameter with a gradient)")
        median = statistics.median(floor for _, floor, _ in rows)
        return max((deviation(max(f, median), lk, 1.0, name) for name, f, lk in rows), key=lambda d: d.ratio)


def median_raised(worst: RunningMax) -> dict[str, Deviation]:
    """Per key, each floor raised to the median floor over keys (the rule of ``GradErrors``) and to
    ``MIN_FLOOR_REL`` x the largest magnitude over keys (for the logits: per sample, over the row)."""
    scale = max(worst.scale.values(), default=0.0)
    median = statistics.median(worst.floor.values())
    return {k: deviation(max(worst.floor[k], median), worst.leak[k], scale, k) for k in worst.floor}


__all__ = ["MIN_FLOOR_REL", "Deviation", "GradErrors", "RunningMax", "deviation", "max_abs", "median_raised"]
