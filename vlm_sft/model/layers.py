"""Qwen3.5 text decoder layers on the flattened varlen layout: every token mixer honours the segment boundaries.

Parameter names, shapes and the math follow transformers' ``modeling_qwen3_5`` (``Qwen3_5RMSNorm``,
``Qwen3_5RMSNormGated``, ``Qwen3_5MLP``, ``Qwen3_5GatedDeltaNet``, ``Qwen3_5Attention``, ``Qwen3_5DecoderLayer``)
so that a Hugging Face state dict loads unchanged. What differs is the layout: all rows of a batch are flattened
into one token axis T and the segments (samples, padding) are described by one ``Segments``; the only ops that mix
tokens (full attention, the GatedDeltaNet recurrence and its short causal conv) are the registry's varlen ops,
which never look across a segment start. Everything else is per token.

Precision: norms, the decay ``g`` and rotary run in float32 like transformers, whatever the autocast dtype.

Legend: T = tokens, D = hidden size, H = heads, K = key head dim, V = value head dim, C = conv channels,
W = conv kernel width, R = rotary dims.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3_5TextConfig

from vlm_sft.model.attention import varlen_attention
from vlm_sft.model.backends import Backends
from vlm_sft.model.context_parallel import NO_CP, ContextParallel, kv_heads_layout, qkv_channels, qkv_rank_order
from vlm_sft.model.conv import causal_conv1d, conv_step, conv_tail
from vlm_sft.model.gdn import final_states, gated_delta_rule, recurrent_step
from vlm_sft.model.rotary import apply_partial_rotary
from vlm_sft.model.varlen import Segments

if TYPE_CHECKING:
    from vlm_sft.model.decode import AttnCache, LinearAttnCache


class RMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: ``norm(x) * (1 + weight)`` in float32 (weight initialised to 0)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class RMSNormGated(nn.Module):
    """RMSNorm then SiLU gate, on each value head of the GatedDeltaNet output (weight initialised to 1).

    Rounding order copies transformers: normalise in float32, cast to the input dtype, scale by the weight,
    multiply by ``silu(gate)`` in float32, cast back.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight * xf.to(input_dtype)
        out = out * F.silu(gate.float())
        return out.to(input_dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ShortConv(nn.Module):
    """Depthwise causal conv over the packed token axis; its taps never reach across a segment start.

    Holds ``weight`` ``[C, 1, W]`` exactly like the ``nn.Conv1d`` it replaces (same state-dict key
    ``conv1d.weight``), but runs through the registry's varlen conv instead of a padded ``F.conv1d``.
    """

    def __init__(self, channels: int, kernel_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None

    def forward(
        self, x_TC: torch.Tensor, segments: Segments, backend: str, channels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``channels``: the indices of the channels ``x_TC`` holds (a context-parallel head shard); None: all."""
        weight, bias = self.weight.squeeze(1), self.bias
        if channels is not None:
            weight = weight[channels.to(weight.device)]
            bias = None if bias is None else bias[channels.to(bias.device)]
        return causal_conv1d(x_TC, weight, bias, segments, backend=backend, activation="silu")


class GatedDeltaNet(nn.Module):
    """Qwen3.5 linear-attention block: short conv over q/k/v, gated delta rule, gated RMSNorm, output proj.

    The recurrent state starts from zero at every segment start, so a packed sample sees exactly what it would
    see alone. Key heads are repeated to the value-head count before the rule, as transformers does.
    """

    def __init__(self, config: Qwen3_5TextConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_v_heads = config.linear_num_value_heads
        self.num_k_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads={self.num_v_heads} must be a multiple of "
                f"linear_num_key_heads={self.num_k_heads}"
            )
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r}: only 'silu' (the Qwen3.5 activation) is supported")
        self.conv_dim = 2 * self.key_dim + self.value_dim
        # Registration order mirrors transformers (state dicts are keyed by name, this only eases reading).
        self.conv1d = ShortConv(self.conv_dim, config.linear_conv_kernel_dim)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(0.01, 16).log())
        self.norm = RMSNormGated(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(self.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)

    def forward(
        self,
        x_TD: torch.Tensor,
        segments: Segments,
        backends: Backends,
        cp: ContextParallel = NO_CP,
        cache: LinearAttnCache | None = None,
    ) -> torch.Tensor:
        """``x_TD``: this rank's tokens; under context parallelism (``cp``) the conv and the rule run on the whole
        sequence for this rank's block of heads, between two all-to-alls (``context_parallel``).

        ``cache`` (``decode``, never with ``cp``): unfilled, the forward runs as usual and stores each segment's conv
        tail and final state; filled, ``x_TD`` is one token per sequence and each op takes one recurrent step."""
        t = x_TD.shape[0]
        qkv_TC, b_TH, a_TH = self.in_proj_qkv(x_TD), self.in_proj_b(x_TD), self.in_proj_a(x_TD)
        channels = None
        if cp.active:
            qkv_TC, b_TH, a_TH = self._to_head_shard(qkv_TC, b_TH, a_TH, cp)
            channels = qkv_channels(self.key_dim, self.value_dim, cp.rank, cp.size, qkv_TC.device)
        T, n_k, n_v = qkv_TC.shape[0], self.num_k_heads // cp.size, self.num_v_heads // cp.size
        step = cache is not None and cache.filled
        if step:
            qkv_TC, cache.conv_tail_SWC = conv_step(qkv_TC, cache.conv_tail_SWC, *self._conv_params())
        else:
            if cache is not None:
                cache.conv_tail_SWC = conv_tail(qkv_TC, segments, self.conv1d.weight.shape[-1])
            qkv_TC = self.conv1d(qkv_TC, segments, backends.conv, channels)
        q_TC, k_TC, v_TC = torch.split(qkv_TC, [n_k * self.head_k_dim] * 2 + [n_v * self.head_v_dim], dim=-1)
        q_THK = q_TC.reshape(T, n_k, self.head_k_dim)
        k_THK = k_TC.reshape(T, n_k, self.head_k_dim)
        v_THV = v_TC.reshape(T, n_v, self.head_v_dim)
        heads = slice(cp.rank * n_v, (cp.rank + 1) * n_v)
        # Log decay in float32: exp(A_log) of a bf16 A_log would be coarse, and fp16 overflows.
        g_TH = -self.A_log[heads].float().exp() * F.softplus(a_TH.float() + self.dt_bias[heads])
        if step:
            o_THV, cache.state_SHKV = recurrent_step(q_THK, k_THK, v_THV, g_TH, b_TH.sigmoid(), cache.state_SHKV)
        else:
            o_THV = gated_delta_rule(
                q_THK, k_THK, v_THV, g_TH, b_TH.sigmoid(), segments, backend=backends.linear_attention,
                use_qk_l2norm=True,
            )  # fmt: skip
            if cache is not None:
                cache.state_SHKV = final_states(q_THK, k_THK, v_THV, g_TH, b_TH.sigmoid(), segments)
        if cp.active:
            o_THV = cp.heads_to_seq(o_THV)
        z_THV = self.in_proj_z(x_TD).reshape(t, self.num_v_heads, self.head_v_dim)
        o_THV = self.norm(o_THV.reshape(-1, self.head_v_dim), z_THV.reshape(-1, self.head_v_dim))
        return self.out_proj(o_THV.reshape(t, self.value_dim))

    def _conv_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The short conv's ``(weight_CW, bias_C)`` for ``conv_step``."""
        return self.conv1d.weight.squeeze(1), self.conv1d.bias

    def _to_head_shard(self, qkv_tC, b_tH, a_tH, cp: ContextParallel):
        """One all-to-all for q, k, v (three channel blocks per rank), beta and the decay input."""
        t, size = qkv_tC.shape[0], cp.size
        order = qkv_rank_order(self.key_dim, self.value_dim, size, qkv_tC.device)
        parts = [qkv_tC[:, order].view(t, size, -1), b_tH.view(t, size, -1), a_tH.view(t, size, -1)]
        widths = [p.shape[-1] for p in parts]
        packed = cp.seq_to_heads(torch.cat([p.to(qkv_tC.dtype) for p in parts], dim=-1))  # [T, 1, sum(widths)]
        qkv_TC, b_TH, a_TH = packed.squeeze(1).split(widths, dim=-1)
        return qkv_TC, b_TH.to(b_tH.dtype), a_TH.to(a_tH.dtype)


class GatedAttention(nn.Module):
    """Qwen3.5 full attention: per-head q/k RMSNorm, partial MRoPE, causal varlen GQA, sigmoid output gate.

    ``q_proj`` emits, per head, the query followed by its gate (``[H, 2 * D]``), as in transformers.
    """

    def __init__(self, config: Qwen3_5TextConfig) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        if config.attention_dropout:
            raise ValueError(f"attention_dropout={config.attention_dropout}: set it to 0.0 (not supported)")
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        x_TD: torch.Tensor,
        cos_TR: torch.Tensor,
        sin_TR: torch.Tensor,
        segments: Segments,
        backends: Backends,
        cp: ContextParallel = NO_CP,
        cache: AttnCache | None = None,
    ) -> torch.Tensor:
        """``x_TD``: this rank's tokens; under context parallelism the attention runs on the whole sequence for
        this rank's query heads (and their kv heads), between two all-to-alls (Ulysses).

        ``cache`` (``decode``, never with ``cp``): unfilled, the forward runs as usual and stores each segment's keys
        and values; filled, ``x_TD`` is one token per sequence, attending over its cached keys and its own."""
        T = x_TD.shape[0]
        q_THD, gate_THD = self.q_proj(x_TD).view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q_THD = apply_partial_rotary(self.q_norm(q_THD), cos_TR, sin_TR)
        k_THD = apply_partial_rotary(
            self.k_norm(self.k_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)), cos_TR, sin_TR
        )
        v_THD = self.v_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        # Under autocast the rotated q/k come back in the projection dtype; give the kernel one dtype.
        k_THD, v_THD = k_THD.to(q_THD.dtype), v_THD.to(q_THD.dtype)
        if cp.active:
            q_THD, k_THD, v_THD = self._to_head_shard(q_THD, k_THD, v_THD, cp)
        if cache is not None and cache.filled:
            o_THD = cache.attend(q_THD, k_THD, v_THD, self.scaling)
        else:
            o_THD = varlen_attention(q_THD, k_THD, v_THD, segments, scale=self.scaling, backend=backends.attention)
            if cache is not None:
                cache.fill(k_THD, v_THD, segments)
        if cp.active:
            o_THD = cp.heads_to_seq(o_THD)
        o_TD = o_THD.reshape(T, self.num_heads * self.head_dim) * torch.sigmoid(gate_THD.reshape(T, -1))
        return self.o_proj(o_TD)

    def _to_head_shard(self, q_tHD, k_tHD, v_tHD, cp: ContextParallel):
        """One all-to-all for q, k and v: a rank gets its block of query heads and the kv heads they read (kv
        heads repeated first when ``cp`` exceeds them)."""
        repeat = kv_heads_layout(self.num_kv_heads, cp.size)
        if repeat > 1:
            k_tHD, v_tHD = k_tHD.repeat_interleave(repeat, dim=1), v_tHD.repeat_interleave(repeat, dim=1)
        t, size = q_tHD.shape[0], cp.size
        n_q, n_kv = q_tHD.shape[1] // size, k_tHD.shape[1] // size
        parts = [x.reshape(t, size, -1, self.head_dim) for x in (q_tHD, k_tHD, v_tHD)]
        packed = cp.seq_to_heads(torch.cat(parts, dim=2).reshape(t, -1, self.head_dim))
        return packed.split([n_q, n_kv, n_kv], dim=1)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GatedDeltaNet or gated attention) then MLP.

    ``mlp`` None builds the dense SwiGLU ``MLP`` of ``Qwen3_5TextConfig``; the MoE text decoder passes its
    ``moe.SparseMoeBlock`` instead (``moe_mlp=True``). The layer returns ``(x_TD, router_logits_TE)``, the logits
    None for a dense layer: the decoder collects them for the router statistics (``load_balance``).
    """

    def __init__(self, config: Qwen3_5TextConfig, layer_idx: int, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        elif self.layer_type == "full_attention":
            self.self_attn = GatedAttention(config)
        else:
            raise ValueError(f"layer_types[{layer_idx}]={self.layer_type!r}: expected linear_attention/full_attention")
        self.moe_mlp = mlp is not None
        """True when ``mlp`` is a routed-expert block returning ``(y_TD, router_logits_TE)``."""
        self.mlp = mlp if mlp is not None else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        x_TD: torch.Tensor,
        cos_TR: torch.Tensor,
        sin_TR: torch.Tensor,
        segments: Segments,
        backends: Backends,
        cp: ContextParallel = NO_CP,
        cache: LinearAttnCache | AttnCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``cache``: this layer's decoding cache (``decode``), handed to its token mixer; None in training."""
        h_TD = self.input_layernorm(x_TD)
        if self.layer_type == "linear_attention":
            h_TD = self.linear_attn(h_TD, segments, backends, cp, cache)
        else:
            h_TD = self.self_attn(h_TD, cos_TR, sin_TR, segments, backends, cp, cache)
        x_TD = x_TD + h_TD
        if self.moe_mlp:
            mlp_TD, router_logits_TE = self.mlp(self.post_attention_layernorm(x_TD), backends.experts)
            return x_TD + mlp_TD, router_logits_TE
        return x_TD + self.mlp(self.post_attention_layernorm(x_TD)), None


@torch.no_grad()
def init_text_weights(module: nn.Module, std: float) -> None:
    """Random init of one text module, as transformers' ``Qwen3_5PreTrainedModel._init_weights`` does it.

    Linear and conv weights ~ N(0, std), biases 0; embeddings ~ N(0, std) with the padding row zeroed; the
    zero-centred RMSNorm weights 0 (they act as 1 + w); the gated norm's weight 1; GatedDeltaNet ``dt_bias`` 1
    and ``A_log = log(U(0.01, 16))``. Call through ``Module.apply``.
    """
    if isinstance(module, (nn.Linear, ShortConv)):
        module.weight.normal_(0.0, std)
        if module.bias is not None:
            module.bias.zero_()
    elif isinstance(module, nn.Embedding):
        module.weight.normal_(0.0, std)
        if module.padding_idx is not None:
            module.weight[module.padding_idx].zero_()
    elif isinstance(module, RMSNorm):
        module.weight.zero_()
    elif isinstance(module, RMSNormGated):
        module.weight.fill_(1.0)
    elif isinstance(module, GatedDeltaNet):
        module.dt_bias.fill_(1.0)
        module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 16).log())
