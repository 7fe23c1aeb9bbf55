"""The one place that picks each op's kernel backend from the device, what is installed, and the config request.

Every op of the text model has a pure-torch path that honours segment boundaries on any device, and CUDA paths that
are faster when their packages are installed:

| op                    | CUDA choices (auto order)                | everywhere else |
|-----------------------|------------------------------------------|-----------------|
| full attention        | ``flash_attn``, ``torch_varlen``, ``sdpa`` | ``sdpa``        |
| GatedDeltaNet         | ``fla``, ``torch``                        | ``torch``       |
| short causal conv     | ``fla``, ``causal_conv1d``, ``torch``     | ``torch``       |
| loss                  | ``fla_fused``, ``chunked``                | ``chunked``     |
| MoE routed experts    | ``grouped_mm`` (sm90 / sm100), ``sorted`` | ``grouped_mm``  |

``resolve_backends`` is called once at model build. It never imports flash-linear-attention, triton, flash-attn or
causal-conv1d: availability is probed with ``importlib.util.find_spec`` (and ``torch.cuda``), because importing a
package has side effects (fla probes the device at import and, without triton, exports nothing). The kernels
themselves import their package on first use, on CUDA only. The fla paths also run on the CPU in CI, under Triton's
interpreter (``tests/test_kernels_interpret.py``, ``pytest -m interpret``): tests build ``Backends`` by hand there. A backend requested by name that is
missing or cannot run on the device raises ``BackendUnavailableError`` right away, with the fix; ``"auto"`` takes
the best available one. The choice and the reason are logged once per distinct request.

The conv follows the linear-attention request: ``linear_attn_impl = "torch"`` selects the torch conv too (the whole
GatedDeltaNet layer in pure torch, e.g. to debug), otherwise the fastest varlen conv installed.

The MoE experts (``moe.sorted_experts_mlp`` / ``moe.grouped_experts_mlp``, equal results) need no package: both are
torch. ``grouped_mm`` (``torch._grouped_mm``) is CUTLASS's grouped GEMM with no host sync on CUDA compute capability
9.x / 10.x (H100, H200, B200) with bf16 operands; on older GPUs torch runs it as a loop of matmuls that copies the
offsets to the host at every call (2 syncs per layer forward, 4 in backward, against ``sorted``'s 1), so ``auto``
keeps ``sorted`` there. On the CPU it is the same loop in C++, without ``sorted``'s Python between the matmuls:
``bench/bench_moe.py`` measured a forward + backward of one layer at the 35B-A3B widths (fp32, 2 threads) at 0.79x
``sorted``'s time with the real model's 64 tokens per expert, 0.95x (within noise) with 256, so ``auto`` takes it on
the CPU too. It needs the hidden and expert intermediate sizes to be multiples of 16 bytes
(``moe.check_grouped_mm_widths``).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

ATTN_IMPLS = ("auto", "flash_attn", "torch_varlen", "sdpa")
LINEAR_ATTN_IMPLS = ("auto", "fla", "torch")
LOSS_IMPLS = ("auto", "fla_fused", "chunked")
EXPERTS_IMPLS = ("auto", "sorted", "grouped_mm")


class BackendUnavailableError(RuntimeError):
    """A kernel backend requested by name is not installed, or cannot run on this device. The message says the fix."""


@dataclass(frozen=True)
class Backends:
    """The kernel backend of each op of the text model, as resolved for one device."""

    attention: str
    """Full attention: ``"flash_attn"`` | ``"torch_varlen"`` | ``"sdpa"``; see ``attention.varlen_attention``."""
    linear_attention: str
    """GatedDeltaNet recurrence: ``"fla"`` | ``"torch"``; see ``gdn.gated_delta_rule``."""
    conv: str
    """Short causal conv of the GatedDeltaNet layer: ``"fla"`` | ``"causal_conv1d"`` | ``"torch"``; see ``conv``."""
    loss: str
    """Cross-entropy over hidden states: ``"fla_fused"`` | ``"chunked"``; see ``loss.chunked_cross_entropy``."""
    experts: str = "sorted"
    """MoE routed experts: ``"sorted"`` | ``"grouped_mm"``; see ``moe.sorted_experts_mlp`` / ``grouped_experts_mlp``
    (unused by dense models)."""


def resolve_backends(
    device: torch.device | str,
    attn_impl: str = "auto",
    linear_attn_impl: str = "auto",
    loss_impl: str = "auto",
    experts_impl: str = "auto",
) -> Backends:
    """Choose every op's backend for ``device`` (``"auto"`` = best available; a name = that one or an error).

    Raises ``ValueError`` for an unknown name and ``BackendUnavailableError`` (with the fix) for a named backend that
    is missing or cannot run on ``device``. Logs the choice and its reasons once per distinct request.
    """
    for value, allowed, key in (
        (attn_impl, ATTN_IMPLS, "attn_impl"),
        (linear_attn_impl, LINEAR_ATTN_IMPLS, "linear_attn_impl"),
        (loss_impl, LOSS_IMPLS, "loss_impl"),
        (experts_impl, EXPERTS_IMPLS, "experts_impl"),
    ):
        if value not in allowed:
            raise ValueError(f"model.{key} = {value!r} is not a backend; choose one of {', '.join(allowed)}")
    return _resolve(torch.device(device).type, attn_impl, linear_attn_impl, loss_impl, experts_impl)


@functools.cache
def _resolve(device_type: str, attn_impl: str, linear_attn_impl: str, loss_impl: str, experts_impl: str) -> Backends:
    """Cached per distinct request, so the log line appears once however many layers or models ask."""
    on_cuda = device_type == "cuda" and torch.cuda.is_available()
    reasons: list[str] = []
    attention = _pick_attention(device_type, on_cuda, attn_impl, reasons)
    linear_attention = _pick_linear_attention(device_type, on_cuda, linear_attn_impl, reasons)
    conv = _pick_conv(on_cuda, linear_attention, linear_attn_impl, reasons)
    loss = _pick_loss(device_type, on_cuda, loss_impl, reasons)
    experts = _pick_experts(device_type, on_cuda, experts_impl, reasons)
    chosen = Backends(attention=attention, linear_attention=linear_attention, conv=conv, loss=loss, experts=experts)
    logger.info(
        "kernel backends on %s: attention=%s, linear_attention=%s, conv=%s, loss=%s, experts=%s (%s)",
        device_type,
        chosen.attention,
        chosen.linear_attention,
        chosen.conv,
        chosen.loss,
        chosen.experts,
        "; ".join(reasons),
    )
    return chosen


def _installed(module: str) -> bool:
    """Whether ``module`` could be imported, without importing it (a package's import may have side effects)."""
    return importlib.util.find_spec(module) is not None


def _fla_ready() -> bool:
    # flash-linear-attention imports without triton but then exports nothing: both must be there.
    return _installed("fla") and _installed("triton")


def _torch_varlen_ready() -> bool:
    """torch's varlen attention runs its bundled flash kernel: CUDA sm80+ with flash attention compiled in."""
    return (
        _installed("torch.nn.attention.varlen")
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability()[0] >= 8
    )


def _unavailable(what: str, device_type: str, on_cuda: bool, install: str, fallback: str) -> BackendUnavailableError:
    where = "this CUDA machine" if on_cuda else f"device {device_type!r} (it needs CUDA)"
    return BackendUnavailableError(f"{what} was requested but cannot run on {where}. Fix: {install}, or {fallback}.")


def _pick_attention(device_type: str, on_cuda: bool, request: str, reasons: list[str]) -> str:
    if request == "flash_attn":
        if on_cuda and _installed("flash_attn"):
            reasons.append("attention: flash_attn as requested")
            return "flash_attn"
        raise _unavailable(
            "attn_impl = 'flash_attn'",
            device_type,
            on_cuda,
            "pip install flash-attn on a CUDA machine",
            "set model.attn_impl = 'sdpa' (or 'auto')",
        )
    if request == "torch_varlen":
        if on_cuda and _torch_varlen_ready():
            reasons.append("attention: torch_varlen as requested")
            return "torch_varlen"
        raise _unavailable(
            "attn_impl = 'torch_varlen' (torch.nn.attention.varlen, flash kernel)",
            device_type,
            on_cuda,
            "use a CUDA GPU of compute capability 8.0+ with a torch build that has flash attention",
            "set model.attn_impl = 'sdpa' (or 'auto')",
        )
    if request == "sdpa":
        reasons.append("attention: sdpa as requested")
        return "sdpa"
    if on_cuda and _installed("flash_attn"):
        reasons.append("attention: flash_attn is installed")
        return "flash_attn"
    if on_cuda and _torch_varlen_ready():
        reasons.append("attention: torch varlen flash kernel (flash-attn not installed)")
        return "torch_varlen"
    reasons.append("attention: sdpa per segment bucket" + (" (no varlen flash kernel)" if on_cuda else " (no CUDA)"))
    return "sdpa"


def _pick_linear_attention(device_type: str, on_cuda: bool, request: str, reasons: list[str]) -> str:
    if request == "fla":
        if on_cuda and _fla_ready():
            reasons.append("linear_attention: fla as requested")
            return "fla"
        raise _unavailable(
            "linear_attn_impl = 'fla' (flash-linear-attention)",
            device_type,
            on_cuda,
            "pip install flash-linear-attention (it needs triton) on a CUDA machine",
            "set model.linear_attn_impl = 'torch'",
        )
    if request == "torch":
        reasons.append("linear_attention: torch as requested")
        return "torch"
    if on_cuda and _fla_ready():
        reasons.append("linear_attention: flash-linear-attention is installed")
        return "fla"
    reasons.append(
        "linear_attention: pure-torch varlen chunked rule"
        + (" (flash-linear-attention or triton not installed)" if on_cuda else " (no CUDA)")
    )
    return "torch"


def _pick_conv(on_cuda: bool, linear_attention: str, linear_request: str, reasons: list[str]) -> str:
    if linear_request == "torch" or not on_cuda:
        reasons.append("conv: torch, like the linear attention" if on_cuda else "conv: torch (no CUDA)")
        return "torch"
    if linear_attention == "fla":
        reasons.append("conv: fla varlen conv")
        return "fla"
    if _installed("causal_conv1d"):
        reasons.append("conv: causal-conv1d is installed")
        return "causal_conv1d"
    reasons.append("conv: torch (neither flash-linear-attention nor causal-conv1d installed)")
    return "torch"


def _pick_loss(device_type: str, on_cuda: bool, request: str, reasons: list[str]) -> str:
    if request == "fla_fused":
        if on_cuda and _fla_ready():
            reasons.append("loss: fla fused linear cross-entropy as requested")
            return "fla_fused"
        raise _unavailable(
            "loss_impl = 'fla_fused' (flash-linear-attention)",
            device_type,
            on_cuda,
            "pip install flash-linear-attention (it needs triton) on a CUDA machine",
            "set model.loss_impl = 'chunked'",
        )
    if request == "chunked":
        reasons.append("loss: chunked as requested")
        return "chunked"
    if on_cuda and _fla_ready():
        reasons.append("loss: fla fused linear cross-entropy")
        return "fla_fused"
    reasons.append("loss: chunked cross-entropy")
    return "chunked"


def _grouped_mm_runs(device_type: str, on_cuda: bool) -> bool:
    """``torch._grouped_mm`` exists (torch >= 2.9 on the CPU; the registry never runs it) and the device is one it has
    a kernel for."""
    return hasattr(torch, "_grouped_mm") and (device_type == "cpu" or on_cuda)


def _grouped_mm_fast_on_cuda() -> bool:
    """torch's grouped GEMM kernel (no host sync) runs on compute capability 9.x and 10.x; elsewhere torch loops."""
    return torch.cuda.get_device_capability()[0] in (9, 10)


def _pick_experts(device_type: str, on_cuda: bool, request: str, reasons: list[str]) -> str:
    if request == "grouped_mm":
        if _grouped_mm_runs(device_type, on_cuda):
            slow = on_cuda and not _grouped_mm_fast_on_cuda()
            reasons.append("experts: grouped_mm as requested" + (" (below sm90 torch loops, a sync per call)" * slow))
            return "grouped_mm"
        raise BackendUnavailableError(
            f"experts_impl = 'grouped_mm' (torch._grouped_mm) was requested but cannot run on device {device_type!r} "
            f"with torch {torch.__version__} here (it needs the CPU or a CUDA GPU, and torch >= 2.9). "
            "Fix: run on the CPU or a CUDA GPU, or set model.experts_impl = 'sorted'."
        )
    if request == "sorted":
        reasons.append("experts: sorted as requested")
        return "sorted"
    if on_cuda and _grouped_mm_runs(device_type, on_cuda) and _grouped_mm_fast_on_cuda():
        reasons.append("experts: grouped_mm, torch's grouped GEMM on sm90/sm100 (bf16), no host sync")
        return "grouped_mm"
    if on_cuda:
        reasons.append("experts: sorted (torch's grouped GEMM kernel needs sm90/sm100; elsewhere it syncs per call)")
        return "sorted"
    if _grouped_mm_runs(device_type, on_cuda):
        reasons.append(
            "experts: grouped_mm, 0.79x the sorted path's time on the CPU at 64 tokens per expert (bench_moe.py)"
        )
        return "grouped_mm"
    reasons.append(f"experts: sorted (no torch._grouped_mm kernel on {device_type!r})")
    return "sorted"


__all__ = [
    "ATTN_IMPLS",
    "EXPERTS_IMPLS",
    "LINEAR_ATTN_IMPLS",
    "LOSS_IMPLS",
    "BackendUnavailableError",
    "Backends",
    "resolve_backends",
]
