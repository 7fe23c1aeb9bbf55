"""The MoE load-balancing loss on the whole optimizer step, and the routing metrics.

The loss (``vlm_sft.model.load_balance``) is ``aux = E * sum_e C_e P_e / N^2`` over the step's real tokens on every
rank and micro-batch: ``C`` the top-k selections per expert, ``P`` the router probability sums, ``N`` = MoE layers
x real tokens. The trainer's objective is then ``sum of token losses / trainable tokens + coef * aux``, the same
as transformers' ``loss + router_aux_loss_coef * aux_loss`` for a batch that is the whole step, so any split into
ranks and micro-batches trains on the same objective (2 ranks x 2 micro-batches == 1 rank x 4, tested).

Why it is exact. ``C`` carries no gradient, so ``d aux = E / N^2 * sum_e C_e dP_e``, and ``P`` is a sum over
micro-batches: micro-batch ``m`` contributes ``coef * E / N^2 * C . P_m`` to the loss it backpropagates, with
``C`` and ``N`` the **step's** totals. ``N`` comes from the step's one all-reduce (before any forward). ``C`` must
be known before the first backward:

- one micro-batch per rank: after its forward, ``C`` is read from the device and summed over ranks (one small
  host all-reduce of ``M x E`` numbers; the trainer's collectives are host tensors, see ``parallel.collectives``);
- several: a routing pre-pass first runs every micro-batch forward without gradient and without the LM head
  (``Qwen3_5VLM.forward(routing_only=True)``), about a third of a step's compute, only while ``coef > 0``.

FSDP averages gradients over ranks, so each term is multiplied by ``world_size``, as the token loss is.

Legend: M = MoE layers, E = experts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vlm_sft.config import ConfigError
from vlm_sft.data.batch import PackedBatch
from vlm_sft.model.load_balance import RouterStats, load_balancing_loss
from vlm_sft.model.moe import is_moe_text_config
from vlm_sft.parallel.collectives import all_reduce_sum
from vlm_sft.parallel.env import DistEnv
from vlm_sft.parallel.parallelize import routed_experts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterBalance:
    """The load-balancing settings of an MoE run (None for a dense model: ``for_model``)."""

    coef: float
    """Weight of the step-global load-balancing loss (0: statistics only)."""
    num_layers: int
    num_experts: int

    @classmethod
    def for_model(cls, model: torch.nn.Module, requested: float | None, *, log: bool = True) -> RouterBalance | None:
        """``model.router_aux_loss_coef`` (None: the checkpoint's) for an MoE model; None for a dense one."""
        text = model.config.text_config
        if not is_moe_text_config(text):
            if requested is not None:
                raise ConfigError(
                    f"model.router_aux_loss_coef = {requested} but {type(text).__name__} is a dense model (no "
                    "router); remove the setting"
                )
            return None
        coef = float(text.router_aux_loss_coef if requested is None else requested)
        moe_layers = len(routed_experts(model))
        balance = cls(coef=coef, num_layers=moe_layers, num_experts=int(text.num_experts))
        if log:
            source = "the checkpoint's" if requested is None else "model.router_aux_loss_coef"
            logger.info(
                "MoE: %d layers of %d experts (top-%d); load-balancing loss coef %g (%s)%s",
                moe_layers, balance.num_experts, text.num_experts_per_tok, coef, source,
                ", on the whole step" if coef > 0 else ": off, routing statistics only",
            )  # fmt: skip
        return balance

    @property
    def trains(self) -> bool:
        return self.coef > 0

    def forward_kwargs(self, batch: PackedBatch) -> dict:
        """What the model needs beside ``batch.model_kwargs()``: the real tokens, and whether P needs a gradient."""
        return {"router_mask": batch.real_mask(), "router_probs_grad": self.trains}

    def prepass_counts(self, model: torch.nn.Module, batches: list[PackedBatch], env: DistEnv) -> torch.Tensor:
        """The step's ``C`` (``[M, E]``, summed over micro-batches and ranks) from forwards without gradient or LM
        head, for steps of several micro-batches (every rank runs the same number: FSDP's collectives agree).
        ``batches`` are on the device already: the step's forwards reuse them."""
        counts = torch.zeros(self.num_layers, self.num_experts, device=env.device)
        with torch.no_grad():
            for batch in batches:
                stats = model(**batch.model_kwargs(), **self.forward_kwargs(batch), routing_only=True)
                counts += stats.counts_ME
        return self.global_counts(counts, env)

    def global_counts(self, counts_ME: torch.Tensor, env: DistEnv) -> torch.Tensor:
        """``counts_ME`` summed over ranks, back on its device (one host read and one host all-reduce)."""
        return all_reduce_sum(counts_ME.cpu().double(), env).to(counts_ME.device, torch.float32)

    def aux_term(self, stats: RouterStats, step_counts: torch.Tensor | None, real_tokens: int, env: DistEnv):
        """This micro-batch's share of ``coef * aux`` (times ``world_size``, for FSDP's average), to add to its
        scaled token loss before backward. ``step_counts`` None: this is the step's only micro-batch."""
        counts = step_counts if step_counts is not None else self.global_counts(stats.counts_ME, env)
        return self.coef * env.world_size * load_balancing_loss(counts, stats.probs_ME, real_tokens)


class StepRouting:
    """The step's router sums on this rank (detached, on the device), read once with the step's loss."""

    def __init__(self) -> None:
        self.counts_ME: torch.Tensor | None = None
        self.probs_ME: torch.Tensor | None = None

    def add(self, stats: RouterStats) -> None:
        counts, probs = stats.counts_ME.detach(), stats.probs_ME.detach()
        self.counts_ME = counts if self.counts_ME is None else self.counts_ME + counts
        self.probs_ME = probs if self.probs_ME is None else self.probs_ME + probs

    def flat(self) -> torch.Tensor:
        """``[counts..., probs...]`` as float64 (empty for a dense model), to ride along the step's one read."""
        if self.counts_ME is None:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([self.counts_ME.reshape(-1), self.probs_ME.reshape(-1)]).double()


def routing_metrics(flat: torch.Tensor, balance: RouterBalance, real_tokens: int) -> dict[str, float]:
    """Metrics of one step from ``StepRouting.flat`` summed over ranks: the load-balancing loss (before its coef)
    and tokens per expert (per layer: min and max over every layer's experts, and the mean over layers of the
    coefficient of variation; 0 is perfect balance)."""
    if flat.numel() == 0:
        return {}
    shape = (balance.num_layers, balance.num_experts)
    counts_ME, probs_ME = flat[: flat.numel() // 2].view(shape), flat[flat.numel() // 2 :].view(shape)
    cv = counts_ME.std(dim=1, correction=0) / counts_ME.mean(dim=1).clamp_min(1e-12)
    return {
        "aux_loss": float(load_balancing_loss(counts_ME, probs_ME, max(real_tokens, 1))),
        "tokens_per_expert_min": float(counts_ME.min()),
        "tokens_per_expert_max": float(counts_ME.max()),
        "tokens_per_expert_cv": float(cv.mean()),
    }
