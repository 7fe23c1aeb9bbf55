"""Device-to-host reads on the model path: O(1) per training step, never O(layers).

On CUDA every read of a device value into Python (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``) and every op
whose output size depends on the data (``nonzero``, boolean indexing, ``repeat_interleave`` without an output size)
stalls the CPU until the GPU catches up. The CPU cannot time that, but it can count it: ``HostReads`` counts those
ops under a ``TorchDispatchMode`` (plus Python-level ``tolist``, which bypasses the dispatcher on CPU tensors) while
a forward and backward run, and the count must not grow with the number of decoder layers. It fails on the model as
it was before the segment layout was built once per forward from host ints (three ``.tolist()`` reads per
GatedDeltaNet layer and one per attention layer).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vlm_sft.data.collate import collate
from vlm_sft.data.pack import make_packer, pack_stream
from vlm_sft.data.shift import shift_sample
from vlm_sft.data.synthetic import ImageSpan, TextSpan, compose_sample
from vlm_sft.model import build_model, tiny_qwen3_5_config, varlen

aten = torch.ops.aten
SYNCING_OPS = {
    aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
    aten.nonzero.default,
    aten.masked_select.default,
    aten.repeat_interleave.Tensor,
    aten._unique2.default,
    aten.unique_consecutive.default,
}
"""Ops that make a CUDA stream wait for the host (or the host for the stream): their result size or value is read."""


class HostReads(TorchDispatchMode):
    """Counts syncing ops (by name) while active; ``Tensor.tolist`` is counted through a patch (see module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self._tolist = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING_OPS or (func is aten.index.Tensor and _has_bool_index(args)):
            self.counts[str(func)] = self.counts.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counts, real = self.counts, self._tolist

        def tolist(tensor):
            counts["tolist"] = counts.get("tolist", 0) + 1
            return real(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _has_bool_index(args) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()))


def _batch():
    """One packed row: text-only and image samples, short and multi-chunk segments, and padding."""
    samples = [
        compose_sample([TextSpan(3), ImageSpan(4, 4), TextSpan(6, True)], sample_index=0),
        compose_sample([TextSpan(70), TextSpan(20, True)], sample_index=1),
        compose_sample([ImageSpan(2, 4), TextSpan(4, True)], sample_index=2),
    ]
    pack = next(pack_stream([shift_sample(s) for s in samples], make_packer("cat", 160)))
    return collate([pack])


def _count_step(layers: int, *, checkpointing: bool = False) -> HostReads:
    torch.manual_seed(0)
    model = build_model(
        tiny_qwen3_5_config(num_hidden_layers=layers), freeze_vision=False, activation_checkpointing=checkpointing
    )
    batch = _batch()
    varlen.clear_layout_caches()  # layouts are cached per length list: count the first (worst) forward
    with HostReads() as reads:
        loss_sum, _ = model(**batch.model_kwargs())
        loss_sum.backward()
    return reads


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_host_reads_per_step_do_not_grow_with_layers(checkpointing):
    few, many = _count_step(4, checkpointing=checkpointing), _count_step(12, checkpointing=checkpointing)
    assert few.counts == many.counts, f"4 layers: {few.counts}\n12 layers: {many.counts}"
    assert few.total <= 40, few.counts  # O(1): the vision tower's and the input checks' few reads


def test_the_counter_sees_per_layer_reads(monkeypatch):
    """The counter can fail: a kernel that reads its segment lengths back from the device in every layer (as the
    torch kernels did through ``cu_seqlens.tolist()``) makes the count grow with the layers."""
    import vlm_sft.model.layers as layers

    real_conv = layers.causal_conv1d

    def reading_conv(x_TC, weight, bias, segments, **kwargs):
        segments.cu_seqlens.tolist()
        return real_conv(x_TC, weight, bias, segments, **kwargs)

    monkeypatch.setattr(layers, "causal_conv1d", reading_conv)
    few, many = _count_step(4), _count_step(12)
    assert many.counts["tolist"] - few.counts["tolist"] == 6  # one more read per GatedDeltaNet layer (9 - 3)
