"""Qwen3.5 text decoder layers on the flattened varlen layout: every token mixer honours the segment boundaries.

Parameter names, shapes and the math follow transformers' ``modeling_qwen3_5`` (``Qwen3_5RMSNorm``,
``Qwen3_5RMSNormGated``, ``Qwen3_5MLP``, ``Qwen3_5GatedDeltaNet``, ``Qwen3_5Attention``, ``Qwen3_5DecoderLayer``)
so that a Hugging Face state dict loads unchanged. What differs is the layout: all rows of a batch are flattened
into one token axis T and the segments (samples, padding) are described by one ``Segments``; the only ops that mix
tokens (full attention, the GatedDeltaNet recurrence and its short causal conv) are the registry's varlen ops,
which never look across a segment start. Everything else is per token.

Each token mixer is three steps, ``forward = output(core(project(x)))``: per-token projections, the op that mixes
tokens (``core``, which may hold only a block of the heads: ``sequence_split.HeadBlock``), the per-token output.
Context parallelism runs its all-to-alls between them from outside (``vlm_sft.parallel.context_parallel``).

Precision: norms, the decay ``g`` and rotary run in float32 like transformers, whatever the autocast dtype.

Legend: T = tokens, t = tokens of ``output`` (a context-parallel rank's shard of T, else T), D = hidden size,
H = heads, K = key head dim, V = value head dim, C = conv channels, W = conv kernel width, R = rotary dims.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3_5TextConfig

from vlm_sft.model.attention import varlen_attention
from vlm_sft.model.backends import Backends
from vlm_sft.model.conv import causal_conv1d, conv_step, conv_tail
from vlm_sft.model.gdn import final_states, gated_delta_rule, recurrent_step
from vlm_sft.model.rotary import apply_partial_rotary
from vlm_sft.model.sequence_split import ALL_HEADS, HeadBlock, qkv_channels
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
        self, x_TD: torch.Tensor, segments: Segments, backends: Backends, cache: LinearAttnCache | None = None
    ) -> torch.Tensor:
        """Every head on the tokens ``x_TD``: ``output(core(project(x)))``. Context parallelism wraps these three steps
        from outside (``vlm_sft.parallel.context_parallel``), so this block holds no communication.

        ``cache`` (``decode``): unfilled, the forward runs as usual and stores each segment's conv tail and final
        state; filled, ``x_TD`` is one token per sequence and each op takes one recurrent step."""
        return self.output(self.core(*self.project(x_TD), segments, backends, cache), x_TD)

    def project(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rule's per-token inputs, every head: ``(qkv_TC, b_TH, a_TH)`` (the fused pre-conv q, k, v; beta and
        the decay input, before their activations)."""
        return self.in_proj_qkv(x_TD), self.in_proj_b(x_TD), self.in_proj_a(x_TD)

    def core(
        self,
        qkv_TC: torch.Tensor,
        b_TH: torch.Tensor,
        a_TH: torch.Tensor,
        segments: Segments,
        backends: Backends,
        cache: LinearAttnCache | None = None,
        heads: HeadBlock = ALL_HEADS,
    ) -> torch.Tensor:
        """The conv and the gated delta rule over the tokens of ``segments``: ``o_THV``. ``heads``: the inputs hold
        that block of the heads (their channels ``qkv_channels``), so the conv's weight and ``A_log`` / ``dt_bias``
        are sliced to match; the default is every head."""
        channels = None
        if heads.count > 1:
            channels = qkv_channels(self.key_dim, self.value_dim, heads.index, heads.count, qkv_TC.device)
        T, n_k, n_v = qkv_TC.shape[0], self.num_k_heads // heads.count, self.num_v_heads // heads.count
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
        mine = heads.of(self.num_v_heads)
        # Log decay in float32: exp(A_log) of a bf16 A_log would be coarse, and fp16 overflows.
        g_TH = -self.A_log[mine].float().exp() * F.softplus(a_TH.float() + self.dt_bias[mine])
        if step:
            o_THV, cache.state_SHKV = recurrent_step(q_THK, k_THK, v_THV, g_TH, b_TH.sigmoid(), cache.state_SHKV)
            return o_THV
        o_THV = gated_delta_rule(
            q_THK, k_THK, v_THV, g_TH, b_TH.sigmoid(), segments, backend=backends.linear_attention, use_qk_l2norm=True
        )
        if cache is not None:
            cache.state_SHKV = final_states(q_THK, k_THK, v_THV, g_TH, b_TH.sigmoid(), segments)
        return o_THV

    def output(self, o_tHV: torch.Tensor, x_tD: torch.Tensor) -> torch.Tensor:
        """``y_tD`` of the rule's output ``o_tHV`` (every head) on the tokens ``x_tD`` it came from: the gated norm
        (its gate ``in_proj_z(x)``) and ``out_proj``."""
        t = x_tD.shape[0]
        z_tHV = self.in_proj_z(x_tD).reshape(t, self.num_v_heads, self.head_v_dim)
        o_tHV = self.norm(o_tHV.reshape(-1, self.head_v_dim), z_tHV.reshape(-1, self.head_v_dim))
        return self.out_proj(o_tHV.reshape(t, self.value_dim))

    def _conv_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The short conv's ``(weight_CW, bias_C)`` for ``conv_step``."""
        return self.conv1d.weight.squeeze(1), self.conv1d.bias


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
        cache: AttnCache | None = None,
    ) -> torch.Tensor:
        """Every head on the tokens ``x_TD``: ``output(core(project(x)))``. Context parallelism wraps these three steps
        from outside (``vlm_sft.parallel.context_parallel``), so this block holds no communication.

        ``cache`` (``decode``): unfilled, the forward runs as usual and stores each segment's keys and values;
        filled, ``x_TD`` is one token per sequence, attending over its cached keys and its own."""
        q_THD, k_THD, v_THD, gate_THD = self.project(x_TD, cos_TR, sin_TR)
        return self.output(self.core(q_THD, k_THD, v_THD, segments, backends, cache), gate_THD)

    def project(
        self, x_TD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_THD, k_THD, v_THD, gate_THD)``, every head: q and k normed and rotated, in one dtype."""
        T = x_TD.shape[0]
        q_THD, gate_THD = self.q_proj(x_TD).view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q_THD = apply_partial_rotary(self.q_norm(q_THD), cos_TR, sin_TR)
        k_THD = apply_partial_rotary(
            self.k_norm(self.k_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)), cos_TR, sin_TR
        )
        v_THD = self.v_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        # Under autocast the rotated q/k come back in the projection dtype; give the kernel one dtype.
        return q_THD, k_THD.to(q_THD.dtype), v_THD.to(q_THD.dtype), gate_THD

    def core(
        self,
        q_THD: torch.Tensor,
        k_THD: torch.Tensor,
        v_THD: torch.Tensor,
        segments: Segments,
        backends: Backends,
        cache: AttnCache | None = None,
    ) -> torch.Tensor:
        """Causal GQA over the tokens of ``segments``, for whatever heads q, k and v hold (no per-head parameter):
        ``o_THD``."""
        if cache is not None and cache.filled:
            return cache.attend(q_THD, k_THD, v_THD, self.scaling)
        o_THD = varlen_attention(q_THD, k_THD, v_THD, segments, scale=self.scaling, backend=backends.attention)
        if cache is not None:
            cache.fill(k_THD, v_THD, segments)
        return o_THD

    def output(self, o_tHD: torch.Tensor, gate_tHD: torch.Tensor) -> torch.Tensor:
        """``y_tD`` of the attention output ``o_tHD`` (every head): the sigmoid gate, then ``o_proj``."""
        t = o_tHD.shape[0]
        return self.o_proj(o_tHD.reshape(t, self.num_heads * self.head_dim) * torch.sigmoid(gate_tHD.reshape(t, -1)))


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
        cache: LinearAttnCache | AttnCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``cache``: this layer's decoding cache (``decode``), handed to its token mixer; None in training."""
        h_TD = self.input_layernorm(x_TD)
        if self.layer_type == "linear_attention":
            h_TD = self.linear_attn(h_TD, segments, backends, cache)
        else:
            h_TD = self.self_attn(h_TD, cos_TR, sin_TR, segments, backends, cache)
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
