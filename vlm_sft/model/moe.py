"""The Qwen3.5-MoE routed-expert MLP block on the flattened token axis: per-token routing, no token ever dropped.

Math (transformers' ``Qwen3_5MoeSparseMoeBlock``, per token ``x`` of width D)::

    logits = W_router x                                    (in x's dtype; returned for the load-balancing loss)
    p = softmax(logits) in float32
    (w_1..w_k, e_1..e_k) = topk(p, k);  w_i = w_i / sum_j w_j;  w cast back to x's dtype
    routed = sum_i w_i * down_{e_i}(silu(gate_{e_i} x) * up_{e_i} x)
    y = routed + sigmoid(g . x) * shared_expert(x)

The top-k renormalisation is unconditional (``Qwen3_5MoeTextConfig`` has no ``norm_topk_prob``). Every step is per
token, so a packed row needs no ``seq_lens`` here (the load-balancing loss is computed later, from the logits).
Parameter names and shapes are transformers' in-memory ones: ``gate.weight`` ``[E, D]``, ``experts.gate_up_proj``
``[E, 2I, D]`` (gate rows, then up rows), ``experts.down_proj`` ``[E, D, I]``, ``shared_expert.*``,
``shared_expert_gate.weight`` ``[1, D]``; the per-expert keys on disk are the checkpoint adapter's job.

Expert compute, one signature and one result (``EXPERT_PATHS``, picked by ``backends.resolve_backends``):
``sorted_experts_mlp`` ("sorted", the pure-torch reference: slots sorted by expert, one matmul pair per active
expert, one host sync per call) and ``grouped_experts_mlp`` ("grouped_mm": the same sort, then one
``torch._grouped_mm`` from device offsets, no host read; its width rule is ``check_grouped_mm_widths``). No capacity
factor on either. Activation checkpointing replays the forward's routing (``RoutingReplay``,
``routing_replay_contexts``), so a recompute that would pick other experts cannot change the gradients. Why, and what
``_grouped_mm`` needs: docs/moe.md, "Design notes".

Legend: T = tokens, D = hidden size, E = experts, K = experts per token (top-k), I = expert intermediate size,
F = 2I (fused gate and up rows), N = T * K routed token slots.
"""

from __future__ import annotations

from contextvars import ContextVar, Token

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3_5MoeTextConfig

from vlm_sft.model.layers import MLP

EXPERT_PATHS = ("sorted", "grouped_mm")
"""Names of the routed-expert paths (the registry in ``backends`` adds "auto")."""


def is_moe_text_config(config: object) -> bool:
    """True for a Qwen3.5-MoE text config (its decoder layers hold a ``SparseMoeBlock`` instead of a dense MLP)."""
    return isinstance(config, Qwen3_5MoeTextConfig)


def route(
    x_TD: torch.Tensor, weight_ED: torch.Tensor, top_k: int, experts_TK: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k softmax routing as ``Qwen3_5MoeTopKRouter`` computes it; returns ``(logits_TE, weights_TK, experts_TK)``.

    The softmax runs in float32 whatever the input dtype (bf16 probabilities would tie and flip near-equal experts);
    the top-k weights are renormalised to sum to 1 and cast back to the logits' dtype, which is the dtype the expert
    outputs are scaled in. ``experts_TK`` is int64, ordered by descending probability like ``torch.topk``; passed in
    (a checkpoint recompute replaying its forward's choice, ``RoutingReplay``), it is used instead of a new top-k.
    The weights are the probabilities gathered at the ids either way: the values and gradient of ``torch.topk``'s.
    """
    logits_TE = F.linear(x_TD, weight_ED)
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    if experts_TK is None:
        experts_TK = select_experts(probs_TE, top_k)
    top_TK = probs_TE.gather(-1, experts_TK)
    weights_TK = (top_TK / top_TK.sum(dim=-1, keepdim=True)).to(logits_TE.dtype)
    return logits_TE, weights_TK, experts_TK


def select_experts(probs_TE: torch.Tensor, top_k: int) -> torch.Tensor:
    """The ids ``[T, K]`` (int64) of each token's ``top_k`` most probable experts, descending, as ``torch.topk``.

    On detached probabilities: the choice carries no gradient, and no autograd node means no saved tensor that a
    replayed recompute (which skips this) would lack."""
    return torch.topk(probs_TE.detach(), top_k, dim=-1).indices


def sort_by_expert(experts_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed slots grouped by expert: ``(order_N, offsets_E)``, both on ``experts_TK``'s device, no host sync.

    Slot n of the sorted layout is flat slot ``order_N[n]`` (token ``order_N[n] // K``); the sort is stable, so an
    expert's slots keep token order. ``offsets_E[e]`` (int32, ``_grouped_mm``'s ``offs``) ends expert e's slice: the
    number of slots routed to experts ``<= e``, read from the sorted ids by ``searchsorted``. (``cumsum(bincount)``
    is the same, but CUDA's ``bincount`` reads the ids' minimum and maximum on the host.)
    """
    sorted_expert_N, order_N = torch.sort(experts_TK.reshape(-1), stable=True)
    expert_ids_E = torch.arange(num_experts, device=experts_TK.device, dtype=sorted_expert_N.dtype)
    return order_N, torch.searchsorted(sorted_expert_N, expert_ids_E, right=True, out_int32=True)


def weighted_token_sum(y_ND: torch.Tensor, order_N: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """``[T, D]``: the sorted slots' expert outputs ``y_ND`` (slot n is flat slot ``order_N[n]``, ``sort_by_expert``)
    scaled by their routing weights, put back in ``(t, k)`` order by a gather and summed over k; deterministic (no
    atomic ``index_add``). The last step of every expert path, expert parallelism's included."""
    num_tokens, top_k = weights_TK.shape
    y_ND = y_ND * weights_TK.reshape(-1)[order_N, None]
    inverse_N = torch.empty_like(order_N)
    inverse_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
    return y_ND[inverse_N].view(num_tokens, top_k, y_ND.shape[-1]).sum(dim=1)


def sorted_experts_mlp(
    x_TD: torch.Tensor,
    gate_up_EFD: torch.Tensor,
    down_EDI: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
) -> torch.Tensor:
    """Exact routed-expert SwiGLU: ``y_t = sum_k w_tk * down_e(silu(gate_e x_t) * up_e x_t)`` with ``e = experts_TK[t, k]``.

    The N = T * K token slots are stably sorted by expert so each expert's tokens are one contiguous slice; every
    expert with at least one token runs one ``[n, D] x [D, F]`` and one ``[n, I] x [I, D]`` matmul on exactly its
    tokens (no capacity, no padding, no dropping). The slot outputs are scaled by their routing weight, put back in
    ``(t, k)`` order by a gather and summed over k, which is deterministic (no atomic ``index_add``).

    Reading the per-expert counts (``tolist``) is one host sync per call; ``grouped_experts_mlp`` (same signature)
    keeps them on the device instead.
    """
    num_tokens, top_k = experts_TK.shape
    num_experts, _, hidden = gate_up_EFD.shape
    assert x_TD.shape == (num_tokens, hidden), (x_TD.shape, experts_TK.shape, gate_up_EFD.shape)
    assert weights_TK.shape == experts_TK.shape, (weights_TK.shape, experts_TK.shape)
    if num_tokens == 0:
        return x_TD.new_zeros(0, hidden)

    order_N, offsets_E = sort_by_expert(experts_TK, num_experts)
    counts = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).tolist()
    x_ND = x_TD[order_N // top_k]

    # One unbind, not E indexings: each ``weight[e]``'s backward would add a zero-filled [E, ...] gradient.
    gate_up_FD, down_DI = gate_up_EFD.unbind(0), down_EDI.unbind(0)
    outputs = []
    for expert, x_nD in enumerate(torch.split(x_ND, counts)):
        if x_nD.shape[0] == 0:
            continue
        gate_nI, up_nI = F.linear(x_nD, gate_up_FD[expert]).chunk(2, dim=-1)
        outputs.append(F.linear(F.silu(gate_nI) * up_nI, down_DI[expert]))
    return weighted_token_sum(torch.cat(outputs), order_N, weights_TK)


def grouped_experts_mlp(
    x_TD: torch.Tensor,
    gate_up_EFD: torch.Tensor,
    down_EDI: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
) -> torch.Tensor:
    """``sorted_experts_mlp`` with each projection one ``torch._grouped_mm`` call over all experts: same signature,
    same result (bitwise on the CPU in fp32, where torch runs the same ``mm`` per expert), no host sync.

    The slots are sorted by expert as in ``sorted_experts_mlp`` (``sort_by_expert``), and its device offsets go to
    ``_grouped_mm`` as they are. An expert with no token has an empty group: no work, zero gradient. The operands are cast to one dtype (``_grouped_mm`` is not autocast-enabled): autocast's dtype inside an autocast
    region, else ``x``'s. Raises ``ValueError`` when the hidden or intermediate size breaks its 16-byte alignment.
    """
    num_tokens, top_k = experts_TK.shape
    num_experts, _, hidden = gate_up_EFD.shape
    assert x_TD.shape == (num_tokens, hidden), (x_TD.shape, experts_TK.shape, gate_up_EFD.shape)
    assert weights_TK.shape == experts_TK.shape, (weights_TK.shape, experts_TK.shape)
    dtype = _matmul_dtype(x_TD)
    check_grouped_mm_widths(hidden, down_EDI.shape[-1], dtype)

    order_N, offsets_E = sort_by_expert(experts_TK, num_experts)
    x_ND = x_TD[order_N // top_k].to(dtype)

    gate_NI, up_NI = _grouped_linear(x_ND, gate_up_EFD.to(dtype), offsets_E).chunk(2, dim=-1)
    y_ND = _grouped_linear(F.silu(gate_NI) * up_NI, down_EDI.to(dtype), offsets_E)
    return weighted_token_sum(y_ND, order_N, weights_TK)


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` would compute in: autocast's inside an autocast region on ``x``'s device, else ``x``'s."""
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def check_grouped_mm_widths(hidden: int, inter: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """Raise ``ValueError`` (with the fix) unless ``grouped_experts_mlp`` can run these widths in ``dtype``.

    ``_grouped_mm`` needs every operand's leading stride (here the hidden and intermediate sizes, the gate+up width
    being twice the latter) to be a multiple of 16 bytes: multiples of 4 in float32, of 8 in bf16 / fp16 (the
    default, the stricter). A model build that resolved ``experts = "grouped_mm"`` can call it to fail before the
    first forward."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"experts_impl='grouped_mm' runs in float32, bfloat16 or float16, not {dtype}; use 'sorted'")
    multiple = 16 // torch.empty((), dtype=dtype).element_size()
    if hidden % multiple or inter % multiple:
        raise ValueError(
            f"experts_impl='grouped_mm' needs hidden_size ({hidden}) and moe_intermediate_size ({inter}) to be "
            f"multiples of {multiple} in {dtype} (torch._grouped_mm's 16-byte strides); use experts_impl='sorted'"
        )


def _grouped_linear(x_ND: torch.Tensor, weight_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Rows ``offsets_E[e-1]:offsets_E[e]`` of ``x_ND`` times ``weight_EOI[e]`` transposed: ``[N, I] -> [N, O]``.

    ``_grouped_mm``'s backward multiplies the incoming gradient as it is and refuses one with stride-0 dims (the
    broadcast gradient of a ``sum``); the hook hands it a dense copy instead, and a dense gradient passes through.
    """
    y_NO = torch._grouped_mm(x_ND, weight_EOI.contiguous().transpose(-2, -1), offs=offsets_E)
    if y_NO.requires_grad:
        y_NO.register_hook(_dense_grad)
    return y_NO


def _dense_grad(grad_NO: torch.Tensor) -> torch.Tensor:
    if grad_NO.stride() == (grad_NO.shape[1], 1):
        return grad_NO
    return grad_NO.clone(memory_format=torch.contiguous_format)


class TopKRouter(nn.Module):
    """The router: holds ``weight`` ``[E, D]`` like ``Qwen3_5MoeTopKRouter``; see ``route`` for the math."""

    def __init__(self, config: Qwen3_5MoeTextConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(
        self, x_TD: torch.Tensor, experts_TK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``experts_TK``: ids to reuse instead of a new top-k (a replayed recompute), else None."""
        return route(x_TD, self.weight, self.top_k, experts_TK)


class Experts(nn.Module):
    """The E routed experts as two fused 3-D parameters, named and shaped like ``Qwen3_5MoeExperts``."""

    def __init__(self, config: Qwen3_5MoeTextConfig) -> None:
        super().__init__()
        num_experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, inter))

    def forward(
        self, x_TD: torch.Tensor, experts_TK: torch.Tensor, weights_TK: torch.Tensor, impl: str = "sorted"
    ) -> torch.Tensor:
        """The routed experts' weighted sum ``[T, D]`` by the path named ``impl`` (``EXPERT_PATHS``)."""
        if impl == "sorted":
            return sorted_experts_mlp(x_TD, self.gate_up_proj, self.down_proj, experts_TK, weights_TK)
        if impl == "grouped_mm":
            return grouped_experts_mlp(x_TD, self.gate_up_proj, self.down_proj, experts_TK, weights_TK)
        raise ValueError(f"experts impl {impl!r} is not one of {', '.join(EXPERT_PATHS)}")


class SparseMoeBlock(nn.Module):
    """Routed experts plus the sigmoid-gated shared expert; the MLP of a Qwen3.5-MoE decoder layer.

    Takes the flattened tokens ``x_TD`` of a packed batch and returns ``(y_TD, router_logits_TE)``; the logits are
    in ``x``'s dtype, as transformers records them for its load-balancing loss.
    """

    def __init__(self, config: Qwen3_5MoeTextConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r}: only 'silu' (the Qwen3.5 activation) is supported")
        if not 1 <= config.num_experts_per_tok <= config.num_experts:
            raise ValueError(
                f"num_experts_per_tok={config.num_experts_per_tok} with num_experts={config.num_experts}: "
                "set num_experts_per_tok between 1 and num_experts"
            )
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x_TD: torch.Tensor, experts_impl: str = "sorted") -> tuple[torch.Tensor, torch.Tensor]:
        """``experts_impl`` names the routed-expert path (``EXPERT_PATHS``; ``Backends.experts`` once resolved)."""
        if x_TD.dim() != 2:
            raise ValueError(f"SparseMoeBlock takes flattened tokens [T, D]; got shape {tuple(x_TD.shape)}")
        replay = _ACTIVE_REPLAY.get()
        logits_TE, weights_TK, experts_TK = self.gate(x_TD) if replay is None else replay.route(self.gate, x_TD)
        routed_TD = self.experts(x_TD, experts_TK, weights_TK, impl=experts_impl)
        shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)
        return routed_TD + shared_TD, logits_TE


class RoutingReplay:
    """The top-k expert ids that one checkpointed call's forward chose, one ``[T, K]`` tensor per MoE block in call
    order, handed back in that order to each recompute of the call (why: docs/moe.md, "Design notes")."""

    def __init__(self) -> None:
        self.experts: list[torch.Tensor] = []
        """``experts_TK`` of each MoE block the forward ran; never modified in place (the recompute reuses them)."""


class _ReplayMode:
    """Makes a ``RoutingReplay`` the active one while entered: recording (the checkpointed forward) or replaying (a
    recompute). Re-enterable, as torch enters the recompute context once per recompute (a retained graph's second
    backward recomputes again, from the first block)."""

    def __init__(self, replay: RoutingReplay, recording: bool) -> None:
        self.replay, self.recording = replay, recording
        self._next = 0
        self._token: Token | None = None

    def __enter__(self) -> _ReplayMode:
        self._next = 0
        self._token = _ACTIVE_REPLAY.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE_REPLAY.reset(self._token)

    def route(self, router: TopKRouter, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``router(x_TD)``, recording its expert ids, or given the recorded ones of this block when replaying."""
        if self.recording:
            logits_TE, weights_TK, experts_TK = router(x_TD)
            self.replay.experts.append(experts_TK)
            return logits_TE, weights_TK, experts_TK
        assert self._next < len(self.replay.experts), "a recompute ran more MoE blocks than its forward"
        experts_TK = self.replay.experts[self._next]
        assert experts_TK.shape[0] == x_TD.shape[0], (experts_TK.shape, x_TD.shape)
        self._next += 1
        return router(x_TD, experts_TK)


_ACTIVE_REPLAY: ContextVar[_ReplayMode | None] = ContextVar("moe_routing_replay", default=None)
"""The replay of the checkpointed call now running (forward or recompute); None outside one."""


def routing_replay_contexts() -> tuple[_ReplayMode, _ReplayMode]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: a fresh ``RoutingReplay``
    per checkpointed call, recorded by its forward and replayed by its recompute. Eager only: under
    ``torch.compile`` torch wants two ``TorchDispatchMode`` contexts here."""
    replay = RoutingReplay()
    return _ReplayMode(replay, recording=True), _ReplayMode(replay, recording=False)


@torch.no_grad()
def init_moe_weights(module: nn.Module, std: float) -> None:
    """Random init of the MoE-specific parameters as transformers' ``Qwen3_5MoePreTrainedModel._init_weights`` does.

    Fused expert weights and the router weight ~ N(0, std) (the ``nn.Linear`` of the shared expert and its gate are
    left to ``init_text_weights``). Call through ``Module.apply``.
    """
    if isinstance(module, Experts):
        module.gate_up_proj.normal_(0.0, std)
        module.down_proj.normal_(0.0, std)
    elif isinstance(module, TopKRouter):
        module.weight.normal_(0.0, std)
