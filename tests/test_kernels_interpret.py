"""Our flash-linear-attention paths on the CPU under Triton's interpreter (``interpret`` marker, ``pytest -m interpret``).

The CUDA backends of ``model/backends.py`` (fla's gated delta rule and causal conv with ``cu_seqlens``, its fused
linear cross-entropy) are run through our own entry points (``gated_delta_rule``, ``causal_conv1d``,
``chunked_cross_entropy``, a whole ``Qwen3_5VLM``) with ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py`` when
there is no CUDA), against our torch backends, forward and backward, in float32 and bfloat16, on a packed row with a
zero-length segment and one longer than two chunks of 64. ``tests/triton_interpret.py`` holds the interpreter
workarounds this needs (pinned to triton 3.9.0 / fla 0.6.0). Skipped, with the reason, where the ``interpret`` extra is
not installed; flash-attn and causal-conv1d are CUDA-only and stay in ``tests/test_kernels_gpu.py``.

Tolerances come from the noise-floor machinery (``vlm_sft.checks.noise_floor``), not from guesses: every quantity
(an output, each input's or parameter's gradient) is computed three times: in float64 by our torch backends (the
reference; for the gated delta rule the token-by-token recurrence, float64 all through), at the test dtype by our
torch backends (``floor``: they cannot leak across segments) and at the test dtype by fla (``leak``). Errors are
relative to the reference's magnitude, each floor is raised to the median floor of its quantities (``GradErrors``'
rule) and to ``MIN_FLOOR_REL``, and a test asserts ``leak / floor <= bound``. Measured worst ratios (seeded):

| test                    | float32 | bfloat16 | bound               |
|-------------------------|---------|----------|---------------------|
| gated delta rule        | 0.62    | 2.2      | ``RATIO_BOUND`` = 4 |
| causal conv             | 0.37    | 0.53     | ``RATIO_BOUND`` = 4 |
| fused loss              | 0.82    | 2.2      | ``RATIO_BOUND`` = 4 |
| whole model (gradients) | 56.6    |          | ``MODEL_BOUND`` = 128 |

The model's worst is ``A_log``'s gradient (a sum over tokens that cancels): fla's gate gradient carries 1.0e-3
relative error there, ~57x our float32 rounding (1.8e-5) since our torch path runs chunks of 16 for the tiny model's
key heads (``gdn.default_chunk_size``; with chunks of 64 our floor was ~3x larger and the ratio 15.7); every other
parameter stays within a few times the floor. The bugs below give 1e4 and more.

The lane fails for the bugs it exists for (each tried by hand on the code, then reverted; ratios are leak / floor):

| bug                                                     | float32 test | bfloat16 test | whole model |
|---------------------------------------------------------|--------------|---------------|-------------|
| ``cu_seqlens`` dropped at the fla call in ``gdn.py``    | 1.0e6        | 249           | 9.0e4       |
| ``cu_seqlens`` dropped at the fla call in ``conv.py``   | 5.6e5        | 91            | 9.3e5       |
| fla's fused loss off by 1% (``loss * 1.01``)            | 1.0e4        | 4.4           | 1.0e4       |

``test_lane_sees_a_state_leak`` keeps the first one in the suite: fla given the packed row as one segment must fail
the same comparison.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn.functional as F
from packing_helpers import mixed_row, packed_row

from vlm_sft.checks.noise_floor import Deviation, deviation, max_abs
from vlm_sft.checks.packing_check import RATIO_BOUND, reference_model
from vlm_sft.model import build_model, tiny_qwen3_5_config
from vlm_sft.model.backends import Backends
from vlm_sft.model.conv import causal_conv1d
from vlm_sft.model.gdn import gated_delta_rule, naive_recurrent_gated_delta_rule
from vlm_sft.model.loss import chunked_cross_entropy
from vlm_sft.model.varlen import Segments

pytestmark = pytest.mark.interpret

LENS = [5, 0, 150, 1, 40]
"""A zero-length segment, one of 1 token (shorter than the conv), one over two chunks of 64 (the inter-chunk state
and the gate-gradient scan), one under a chunk."""
MODEL_BOUND = 128.0
"""Whole-model float32 ratio bound (the kernels use the packing check's ``RATIO_BOUND``): ``A_log``'s gradient, a sum
over tokens that cancels, comes out of fla's gate gradient with ~57x our rounding (see the module docstring); a leak
across segments gives 1e4 and more."""
DTYPES = [torch.float32, torch.bfloat16]
FLA = Backends(attention="sdpa", linear_attention="fla", conv="fla", loss="fla_fused")
TORCH = Backends(attention="sdpa", linear_attention="torch", conv="torch", loss="chunked")


@pytest.fixture(scope="module", autouse=True)
def _interpreter() -> None:
    """The workarounds must be in place before the first kernel launch (the interpreter caches rewritten kernels)."""
    import triton_interpret

    triton_interpret.install()


def _exact_in(dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """float64 values that ``dtype`` represents exactly: every run (reference included) sees the same inputs."""
    return x.to(dtype).double()


def _worst(runs: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]]) -> Deviation:
    """``runs``: per quantity name, (reference, floor run, run under test) tensors. Relative errors; each floor raised
    to the median floor over all quantities; the deviation with the largest ratio."""
    rows = []
    for name, (refs, floors, tested) in runs.items():
        for i, (ref, fl, got) in enumerate(zip(refs, floors, tested, strict=True)):
            scale = float(ref.abs().max()) if ref.numel() else 0.0
            if scale > 0.0:
                rows.append((f"{name}[{i}]", max_abs(fl, ref) / scale, max_abs(got, ref) / scale))
    median = statistics.median(f for _, f, _ in rows)
    return max((deviation(max(f, median), lk, 1.0, where) for where, f, lk in rows), key=lambda d: d.ratio)


def _forward_backward(fn, inputs: list[torch.Tensor], dtype: torch.dtype, weight: torch.Tensor):
    """``fn`` on ``inputs`` cast to ``dtype`` (``None`` keeps them): the output and each input's gradient, float64."""
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad((out.double() * weight).sum(), [x for x in leaves if x.requires_grad])
    return [out.detach().double()], [g.double() for g in grads]


def _compare(fn_floor, fn_got, inputs, dtype, fn_ref=None) -> Deviation:
    """The three runs of the module docstring for one op (``fn_ref``, default ``fn_floor``, in float64); returns the
    worst deviation over the output and the gradients."""
    fn_ref = fn_ref or fn_floor
    weight = torch.randn_like(fn_ref(*inputs).double())
    out_ref, g_ref = _forward_backward(fn_ref, inputs, torch.float64, weight)
    out_floor, g_floor = _forward_backward(fn_floor, inputs, dtype, weight)
    out_got, g_got = _forward_backward(fn_got, inputs, dtype, weight)
    return _worst({"output": (out_ref, out_floor, out_got), "grad": (g_ref, g_floor, g_got)})


# ---------------------------------------------------------------------------------------------- GatedDeltaNet


def _gdn_inputs(dtype: torch.dtype, k_heads: int = 2, v_heads: int = 4, dim: int = 32) -> list[torch.Tensor]:
    """2 key heads shared by 4 value heads (fla maps them itself, our torch path repeats them)."""
    t = sum(LENS)
    q, k = torch.randn(t, k_heads, dim), torch.randn(t, k_heads, dim)
    v = torch.randn(t, v_heads, dim)
    g = F.logsigmoid(torch.randn(t, v_heads) + 3.0)  # decays near 1: state carries far, so a leak would show
    beta = torch.rand(t, v_heads)
    return [_exact_in(dtype, x) for x in (q, k, v, g, beta)]


def _gdn(backend: str, lens: list[int] = LENS):
    def run(q, k, v, g, beta):
        return gated_delta_rule(q, k, v, g.float(), beta, Segments.from_lengths(lens), backend=backend)

    return run


def _gdn_reference(q, k, v, g, beta):
    """The token-by-token recurrence, float64 all through (g included)."""
    return naive_recurrent_gated_delta_rule(q, k, v, g, beta, Segments.from_lengths(LENS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gdn_fla_matches_torch(dtype: torch.dtype) -> None:
    dev = _compare(_gdn("torch"), _gdn("fla"), _gdn_inputs(dtype), dtype, _gdn_reference)
    assert dev.ratio <= RATIO_BOUND, dev


def test_lane_sees_a_state_leak() -> None:
    """fla fed the packed row as one segment (what a dropped ``cu_seqlens`` does) fails the same comparison."""
    dev = _compare(_gdn("torch"), _gdn("fla", [sum(LENS)]), _gdn_inputs(torch.float32), torch.float32, _gdn_reference)
    assert dev.ratio > 100 * RATIO_BOUND, dev


# ------------------------------------------------------------------------------------------------------- conv


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_fla_matches_torch(dtype: torch.dtype) -> None:
    channels = 96  # q, k, v channels of a GatedDeltaNet layer at the test shapes above
    inputs = [
        _exact_in(dtype, x) for x in (torch.randn(sum(LENS), channels), torch.randn(channels, 4), torch.randn(channels))
    ]

    def conv(backend: str):
        return lambda x, w, b: causal_conv1d(x, w, b, Segments.from_lengths(LENS), backend=backend)

    dev = _compare(conv("torch"), conv("fla"), inputs, dtype)
    assert dev.ratio <= RATIO_BOUND, dev


# ------------------------------------------------------------------------------------------------------- loss


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_loss_matches_chunked(dtype: torch.dtype) -> None:
    tokens, hidden, vocab = sum(LENS), 64, 500
    targets = torch.randint(0, vocab, (tokens,))
    mask = torch.rand(tokens) > 0.3
    inputs = [_exact_in(dtype, torch.randn(tokens, hidden)), _exact_in(dtype, 0.1 * torch.randn(vocab, hidden))]

    def loss(backend: str):
        return lambda h, w: chunked_cross_entropy(h, w, targets, mask, chunk_size=64, backend=backend)[0]

    dev = _compare(loss("chunked"), loss("fla_fused"), inputs, dtype)
    assert dev.ratio <= RATIO_BOUND, dev


def test_fused_loss_falls_back_to_chunked_for_a_frozen_head() -> None:
    """A head without a gradient takes the chunked path (fla would compute its fp32 gradient anyway)."""
    h = torch.randn(20, 16, requires_grad=True)
    w = torch.randn(50, 16)
    targets, mask = torch.randint(0, 50, (20,)), torch.ones(20, dtype=torch.bool)
    got, _ = chunked_cross_entropy(h, w, targets, mask, backend="fla_fused")
    want, _ = chunked_cross_entropy(h, w, targets, mask, backend="chunked")
    assert got.grad_fn is not None and type(got.grad_fn).__name__ == type(want.grad_fn).__name__
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# -------------------------------------------------------------------------------------------------- the model


def _model_run(model, row: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Loss sum and every trainable parameter's gradient (float64) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    out = model(**row)
    out.loss_sum.backward()
    grads = [p.grad.double() for p in model.parameters() if p.requires_grad]
    return [out.loss_sum.detach().double()], grads


def test_model_fla_backends_match_torch_backends() -> None:
    """A whole ``Qwen3_5VLM`` (float32, attention on SDPA) on a packed row with images and a padding segment:
    the fla backends against the torch backends, both against the float64 torch-backend copy."""
    cfg = tiny_qwen3_5_config()
    # 1 token, one image (17), 3 tokens, two adjacent images (17), a chunk and one token (65), padding (7): the
    # interpreter's time grows with the chunk count, so mixed_row's 64-token sample is left out.
    samples = [s for i, s in enumerate(mixed_row(cfg)) if i not in (1, 5)]
    row = packed_row(samples)
    row["target_ids"] = torch.cat([s["target_ids"] for s in samples])[None]
    row["loss_mask"] = torch.cat([s["loss_mask"] for s in samples])[None]
    lens = [len(s["input_ids"]) for s in samples]
    row["seq_lens"] = torch.tensor(lens)  # the model refuses a zero-length segment; the kernel tests above have one
    torch.manual_seed(0)
    model = build_model(cfg, freeze_vision=False)
    model.backends = TORCH
    reference = reference_model(model)
    row64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in row.items()}
    loss_ref, g_ref = _model_run(reference, row64)
    loss_floor, g_floor = _model_run(model, row)
    model.backends = FLA
    loss_got, g_got = _model_run(model, row)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    dev = _worst({"loss": (loss_ref, loss_floor, loss_got), "grad": (g_ref, g_floor, g_got)})
    where = names[int(dev.where[5:-1])] if dev.where.startswith("grad[") else dev.where
    assert dev.ratio <= MODEL_BOUND, f"{dev} ({where})"
