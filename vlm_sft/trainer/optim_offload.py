"""AdamW's state in host memory between steps (``train.optimizer_offload``), on the device for the step only.

Why: the AdamW state is 8 bytes per trainable parameter, the largest term of a full fine-tune's memory (34.7 GB per
rank for Qwen3.5-35B-A3B on 8 GPUs), and it is needed only inside ``optimizer.step()``, when the step's activations
and gathered layers are already freed. Holding it on the host between steps takes it out of the forward / backward
peak; the step's own peak (parameters, gradients, state) is the other bound (``checks.memory_plan``).

How: an optimizer step pre-hook copies every state tensor to the parameters' device, a post-hook copies it back
(into page-locked memory on CUDA, waited for before the hook returns, so the host copy is complete when a checkpoint
reads it) and drops the device copy; a state-dict load (resume) lands on the host. The step itself runs unchanged
(fused or foreach), on the same values: the update is the same bit for bit. State tensors of FSDP2's sharded
parameters stay DTensors of the same mesh and placements, their local shard on the host (``parallel.fsdp.copy_to``),
so the distributed checkpoint saves and loads them as before.
"""

from __future__ import annotations

import logging

import torch

from vlm_sft.checks.memory_report import format_bytes
from vlm_sft.parallel.fsdp import copy_to

logger = logging.getLogger(__name__)

HOST = torch.device("cpu")


class OptimizerStateOffload:
    """Moves ``optimizer``'s state to the host after each step and back to ``device`` before the next one."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer, self.device = optimizer, device
        self.pin_memory = device.type == "cuda"
        self.on_host = True
        """Where the state is now (no state yet counts as on the host)."""
        self.logged = False
        optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self.to_device())
        optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: self.to_host())
        optimizer.register_load_state_dict_post_hook(lambda _opt: self.to_host())

    def _held(self) -> list[tuple[dict, str, torch.Tensor]]:
        """``(state, key, tensor)`` of every state tensor the offload moves. The step counters (0-dim) stay where
        the implementation keeps them (foreach: on the host)."""
        return [
            (state, key, value)
            for state in self.optimizer.state.values()
            for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        ]

    def _move(self, device: torch.device, *, pin_memory: bool) -> None:
        for state, key, value in self._held():
            state[key] = copy_to(value, device, pin_memory=pin_memory)

    def to_device(self) -> None:
        """Before a step: the state on the parameters' device (the first step creates it there)."""
        if self.on_host:
            self._move(self.device, pin_memory=False)
            self.on_host = False

    def to_host(self) -> None:
        """After a step or a load: the state on the host; the copies are complete when this returns. (Copied also
        when the device is the host, a CPU run: the mechanism the tests hold runs the same there.)"""
        self._move(HOST, pin_memory=self.pin_memory)
        self.on_host = True
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        if not self.logged and self.optimizer.state:
            self.logged = True
            held = format_bytes(self.state_bytes())
            logger.info(
                "train.optimizer_offload: %s of AdamW state held in host memory between steps (this rank)", held
            )

    def state_bytes(self) -> int:
        """Bytes of state held (on the host between steps): what the offload takes out of the device's peak."""
        return sum(_local(value).numel() * value.element_size() for _, _, value in self._held())


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def offload_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> OptimizerStateOffload:
    """Attach the offload to ``optimizer`` (``train.optimizer_offload``); on a CPU run the state stays in host memory
    anyway and the copies only exercise the mechanism (the tests' device)."""
    if device.type == "cpu":
        logger.info("train.optimizer_offload on a CPU run: the AdamW state is in host memory already")
    return OptimizerStateOffload(optimizer, device)
