"""The Qwen3.5 text decoder (``model.language_model.*``), written for packed training.

It takes already-embedded tokens on the flattened layout (so the composite model can scatter image features in
first), the ``[3, T]`` MRoPE positions and the segment boundaries, and returns the final-normed hidden states.
No attention mask: segment boundaries are the only structure, and every layer honours them. Generation passes a
``decode.DecodeCache`` (prefill, then one token per sequence per call); training never does.

Legend: T = tokens (all rows flattened), D = hidden size, R = rotary dims.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

from vlm_sft.model.backends import Backends
from vlm_sft.model.layers import DecoderLayer, RMSNorm
from vlm_sft.model.moe import SparseMoeBlock, is_moe_text_config, routing_replay_contexts
from vlm_sft.model.rotary import MRopeRotary
from vlm_sft.model.varlen import Segments

if TYPE_CHECKING:
    from vlm_sft.model.decode import DecodeCache


class Qwen3_5TextDecoder(nn.Module):
    """Embedding, decoder layers and final norm with transformers' ``Qwen3_5TextModel`` parameter names.

    A ``Qwen3_5MoeTextConfig`` gives every layer a ``moe.SparseMoeBlock`` MLP (``Qwen3_5MoeTextModel``'s names).
    """

    def __init__(self, config: Qwen3_5TextConfig | Qwen3_5MoeTextConfig) -> None:
        super().__init__()
        self.config = config
        # padding_idx as in transformers: the pad row gets no gradient (keeps training identical to theirs).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        moe = is_moe_text_config(config)
        self.layers = nn.ModuleList(
            [
                DecoderLayer(config, i, mlp=SparseMoeBlock(config) if moe else None)
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MRopeRotary(config)
        self.activation_checkpointing = False
        """Recompute each decoder layer in backward (``torch.utils.checkpoint``, non-reentrant); an MoE layer's
        recompute reuses the experts its forward chose (``moe.routing_replay_contexts``)."""

    def forward(
        self,
        embeds_TD: torch.Tensor,
        position_ids_3T: torch.Tensor,
        segments: Segments,
        backends: Backends,
        cache: DecodeCache | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(hidden_TD, router_logits)``: the final-normed hidden states, and each MoE layer's router logits
        ``[T, E]`` in order (empty for the dense model). Under context parallelism the tokens and positions are this
        rank's shard and ``segments`` the whole row's (``vlm_sft.parallel.context_parallel``). ``cache``:
        generation's ``decode.DecodeCache`` (its ``layers[i]`` goes to layer ``i``; never checkpointed, as a
        recomputed layer would update its cache twice)."""
        cos_TR, sin_TR = self.rotary_emb(position_ids_3T)
        h_TD = embeds_TD
        router_logits: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if cache is not None:
                h_TD, logits_TE = layer(h_TD, cos_TR, sin_TR, segments, backends, cache.layers[i])
            elif self.activation_checkpointing and torch.is_grad_enabled():
                args = (h_TD, cos_TR, sin_TR, segments, backends)
                h_TD, logits_TE = checkpoint(layer, *args, use_reentrant=False, context_fn=routing_replay_contexts)
            else:
                h_TD, logits_TE = layer(h_TD, cos_TR, sin_TR, segments, backends)
            if logits_TE is not None:
                router_logits.append(logits_TE)
        return self.norm(h_TD), router_logits
