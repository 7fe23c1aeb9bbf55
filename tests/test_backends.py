"""The backend registry: auto choices per device, named-but-missing backends fail with the fix, logged once."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from vlm_sft.model import backends
from vlm_sft.model.backends import Backends, BackendUnavailableError, resolve_backends
from vlm_sft.model.varlen import Segments

CPU_AUTO = Backends(attention="sdpa", linear_attention="torch", conv="torch", loss="chunked", experts="grouped_mm")


@pytest.fixture(autouse=True)
def _fresh_registry():
    backends._resolve.cache_clear()
    yield
    backends._resolve.cache_clear()


def test_auto_on_cpu_picks_the_pure_torch_paths() -> None:
    assert resolve_backends("cpu") == CPU_AUTO
    assert resolve_backends(torch.device("cpu"), "sdpa", "torch", "chunked", "grouped_mm") == CPU_AUTO


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"linear_attn_impl": "fla"}, "pip install flash-linear-attention (it needs triton) on a CUDA machine"),
        ({"linear_attn_impl": "fla"}, "model.linear_attn_impl = 'torch'"),
        ({"attn_impl": "flash_attn"}, "pip install flash-attn on a CUDA machine"),
        ({"attn_impl": "flash_attn"}, "model.attn_impl = 'sdpa'"),
        ({"attn_impl": "torch_varlen"}, "model.attn_impl = 'sdpa'"),
        ({"loss_impl": "fla_fused"}, "model.loss_impl = 'chunked'"),
    ],
)
def test_requesting_a_cuda_backend_on_cpu_raises_with_the_fix(kwargs: dict, fix: str) -> None:
    with pytest.raises(BackendUnavailableError) as err:
        resolve_backends("cpu", **kwargs)
    assert fix in str(err.value)
    assert "needs CUDA" in str(err.value)


def test_requests_on_cpu_never_import_the_cuda_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend every package is installed: a CPU request must still refuse, and import nothing.
    monkeypatch.setattr(backends, "_installed", lambda module: True)
    before = {m for m in ("fla", "triton", "flash_attn", "causal_conv1d") if m in sys.modules}
    assert resolve_backends("cpu") == CPU_AUTO
    with pytest.raises(BackendUnavailableError):
        resolve_backends("cpu", linear_attn_impl="fla")
    after = {m for m in ("fla", "triton", "flash_attn", "causal_conv1d") if m in sys.modules}
    assert after == before


def test_unknown_backend_name_raises_value_error() -> None:
    with pytest.raises(ValueError, match=r"model\.attn_impl = 'flash' is not a backend; choose one of auto"):
        resolve_backends("cpu", attn_impl="flash")


def test_choice_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vlm_sft.model.backends"):
        resolve_backends("cpu")
        resolve_backends("cpu")
        resolve_backends(torch.device("cpu"))
    records = [r for r in caplog.records if r.name == "vlm_sft.model.backends"]
    assert len(records) == 1
    message = records[0].getMessage()
    assert "attention=sdpa, linear_attention=torch, conv=torch, loss=chunked, experts=grouped_mm" in message
    assert "no CUDA" in message  # the reason is part of the line


def _fake_cuda(
    monkeypatch: pytest.MonkeyPatch, installed: set[str], varlen_flash: bool = False, sm90: bool = False
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "_installed", lambda module: module in installed)
    monkeypatch.setattr(backends, "_torch_varlen_ready", lambda: varlen_flash)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0) if sm90 else (8, 0))


def test_auto_on_cuda_prefers_the_fast_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, {"fla", "triton", "flash_attn", "causal_conv1d"}, varlen_flash=True)
    assert resolve_backends("cuda") == Backends("flash_attn", "fla", "fla", "fla_fused")


def test_auto_on_cuda_without_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, set(), varlen_flash=True)
    assert resolve_backends("cuda") == Backends("torch_varlen", "torch", "torch", "chunked")
    backends._resolve.cache_clear()
    _fake_cuda(monkeypatch, {"causal_conv1d", "fla"})  # fla without triton is not usable
    assert resolve_backends("cuda") == Backends("sdpa", "torch", "causal_conv1d", "chunked")


def test_torch_linear_attention_request_keeps_the_conv_in_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, {"fla", "triton", "causal_conv1d"})
    assert resolve_backends("cuda", linear_attn_impl="torch").conv == "torch"


def test_experts_backend_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU: auto takes grouped_mm (faster there, bench_moe.py), names are honoured, unknown names and a missing
    ``torch._grouped_mm`` fail with the fix; CUDA: grouped_mm on sm90+ only, unless requested."""
    assert resolve_backends("cpu", experts_impl="sorted").experts == "sorted"
    assert resolve_backends("cpu", experts_impl="grouped_mm").experts == "grouped_mm"
    with pytest.raises(ValueError, match=r"model\.experts_impl = 'eager' is not a backend; choose one of auto"):
        resolve_backends("cpu", experts_impl="eager")
    with pytest.raises(BackendUnavailableError, match=r"cannot run on device 'meta'.*model\.experts_impl = 'sorted'"):
        resolve_backends("meta", experts_impl="grouped_mm")
    assert resolve_backends("meta").experts == "sorted"

    backends._resolve.cache_clear()
    monkeypatch.delattr(torch, "_grouped_mm")
    with pytest.raises(BackendUnavailableError, match=r"model\.experts_impl = 'sorted'"):
        resolve_backends("cpu", experts_impl="grouped_mm")
    assert resolve_backends("cpu").experts == "sorted"


def test_experts_on_cuda_follow_the_grouped_gemm_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, set(), sm90=True)
    assert resolve_backends("cuda").experts == "grouped_mm"
    backends._resolve.cache_clear()
    _fake_cuda(monkeypatch, set(), sm90=False)  # e.g. an A100: torch would loop with a host sync per call
    assert resolve_backends("cuda").experts == "sorted"
    assert resolve_backends("cuda", experts_impl="grouped_mm").experts == "grouped_mm"


def test_segments_from_host_lengths() -> None:
    segs = Segments.from_lengths([3, 0, 2])
    assert segs.cu_seqlens.dtype == torch.int32 and segs.cu_seqlens.tolist() == [0, 3, 3, 5]
    assert segs.cu_seqlens_long.dtype == torch.int64 and segs.lengths == (3, 0, 2) and segs.max_len == 3
    assert Segments.from_lengths(torch.tensor([4])).cu_seqlens.tolist() == [0, 4]
    with pytest.raises(ValueError, match="non-negative"):
        Segments.from_lengths([2, -1])
    with pytest.raises(ValueError, match="1-D"):
        Segments.from_lengths([[1, 2]])
    with pytest.raises(ValueError, match="host ints"):
        Segments.from_lengths(torch.tensor([4], device="meta"))
