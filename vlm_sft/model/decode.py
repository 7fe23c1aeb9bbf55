"""Incremental decoding for ``Qwen3_5VLM``: a cache, so greedy generation in eval costs one token per step.

``model(..., cache=DecodeCache())`` first *prefills*: the inputs of a normal forward (in practice one packed row of
S prompts, one segment each, images allowed) run through the usual varlen ops, and the call returns the logits of
every segment's last token ``[S, V]`` while each layer stores what continuing its segment needs:

- a GatedDeltaNet layer (``LinearAttnCache``): the recurrent state after the segment (``gdn.final_states``, fp32)
  and the last ``W - 1`` inputs of its short conv (``conv.conv_tail``);
- a full-attention layer (``AttnCache``): the segment's keys and values after q/k norm and rotary, padded per
  sequence into one buffer with room to grow.

Every later call with that cache *decodes*: one new token per sequence (``input_ids`` ``[S, 1]``, ``position_ids``
``[3, S, 1]``, in the prefill's segment order), one recurrent step per token mixer (``gdn.recurrent_step``,
``conv.conv_step``, attention of the new query over the cached keys plus its own), logits ``[S, V]``. The vision tower
does not run in decode calls, on every rank alike, so FSDP ranks stay in step. MoE and MLP layers are per token and
need nothing. The mode is the cache's: ``DecodeCache.prefilled``.

After a multimodal prompt the next position is not the prompt length: MRoPE numbers an image's tokens on a grid, and
transformers' Qwen3.5 continues at the prompt's largest position + 1, on all three axes (``next_positions``,
``decode_position_ids``).

Every cache class is a plain class, on purpose: FSDP2's pre-forward hooks map over the forward's arguments and
rebuild every dataclass, list and tuple they find (moving tensors to the device, casting them to the mixed-precision
dtype), so a dataclass cache would reach the layers as a copy (the caller's never filled) with its fp32 state cast to
bf16. A plain object is passed through as it is.

Legend: S = sequences (the prefill's segments), T = tokens, H = heads (``H_kv`` kv heads), L = cache length,
D = head dim, V = vocab (logits), W = conv width, K / V = GatedDeltaNet key / value dims in ``state_SHKV``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vlm_sft.model.varlen import Segments

RESERVE_TOKENS = 256
"""Default room each attention layer's k/v buffer gets beyond the longest prompt at the prefill."""


class LinearAttnCache:
    """What one GatedDeltaNet layer needs to continue its sequences (filled by the layer's prefill)."""

    def __init__(self) -> None:
        self.conv_tail_SWC: torch.Tensor | None = None
        """``[S, W - 1, C]``: each sequence's last ``W - 1`` pre-conv ``in_proj_qkv`` outputs, oldest first (zero rows
        in front of a prompt shorter than that), in the projection's dtype."""
        self.state_SHKV: torch.Tensor | None = None
        """``[S, H_v, K, V]`` float32: each sequence's recurrent state after its last token."""

    @property
    def filled(self) -> bool:
        """True once the prefill stored the state: the layer then takes one recurrent step per call."""
        return self.state_SHKV is not None


class AttnCache:
    """One full-attention layer's keys and values per sequence (after q/k norm and rotary), padded to one buffer."""

    def __init__(self, reserve_tokens: int = RESERVE_TOKENS) -> None:
        self.reserve_tokens = reserve_tokens
        """Room beyond the longest prompt that the prefill allocates; a decode step that needs more doubles it."""
        self.k_SHLD: torch.Tensor | None = None
        """``[S, H_kv, L_cap, D]``: sequence ``s``'s keys in ``[:lengths[s]]``, the rest unused."""
        self.v_SHLD: torch.Tensor | None = None
        """``[S, H_kv, L_cap, D]``: the values, laid out as the keys."""
        self.lengths_S: torch.Tensor | None = None
        """int64 ``[S]`` on the device: cached tokens per sequence (where the next key goes)."""
        self.longest = 0
        """Host int: the largest of ``lengths_S`` (every step adds one token to every sequence), so the buffer's
        growth and the attended width need no device read."""

    @property
    def filled(self) -> bool:
        """True once the prefill stored the keys: the layer then attends one new query per sequence per call."""
        return self.k_SHLD is not None

    def fill(self, k_THD: torch.Tensor, v_THD: torch.Tensor, segments: Segments) -> None:
        """Store the prefill's keys and values, segment ``s`` into row ``s`` of the buffers."""
        lengths, (_, heads, dim) = segments.lengths, k_THD.shape
        cap = segments.max_len + self.reserve_tokens
        slots = torch.cat([torch.arange(n) + s * cap for s, n in enumerate(lengths)]).to(k_THD.device)
        buffers = []
        for x_THD in (k_THD, v_THD):
            flat = x_THD.new_zeros(len(lengths) * cap, heads, dim).index_copy_(0, slots, x_THD)
            buffers.append(flat.view(len(lengths), cap, heads, dim).transpose(1, 2).contiguous())
        self.k_SHLD, self.v_SHLD = buffers
        self.lengths_S = torch.tensor(lengths, dtype=torch.int64).to(k_THD.device)
        self.longest = segments.max_len

    def attend(self, q_SHD: torch.Tensor, k_SHD: torch.Tensor, v_SHD: torch.Tensor, scale: float) -> torch.Tensor:
        """Append one key / value per sequence, then attend each sequence's query over its keys: ``o_SHD``.

        One padded SDPA call with a length mask (a key past a sequence's length is masked out); GQA through
        ``enable_gqa`` (each kv head serves ``H // H_kv`` consecutive query heads, as the varlen op).
        """
        if self.longest + 1 > self.k_SHLD.shape[2]:
            self._grow(self.longest + 1)
        rows_S = torch.arange(q_SHD.shape[0], device=q_SHD.device)
        self.k_SHLD[rows_S, :, self.lengths_S] = k_SHD.to(self.k_SHLD.dtype)
        self.v_SHLD[rows_S, :, self.lengths_S] = v_SHD.to(self.v_SHLD.dtype)
        self.lengths_S = self.lengths_S + 1
        self.longest += 1
        keys, values = self.k_SHLD[:, :, : self.longest], self.v_SHLD[:, :, : self.longest]
        mask_S11L = (torch.arange(self.longest, device=q_SHD.device) < self.lengths_S[:, None])[:, None, None, :]
        gqa = q_SHD.shape[1] != keys.shape[1]
        o_SH1D = F.scaled_dot_product_attention(
            q_SHD[:, :, None], keys, values, attn_mask=mask_S11L, scale=scale, enable_gqa=gqa
        )
        return o_SH1D.squeeze(2)

    def _grow(self, needed: int) -> None:
        """Double the buffers' length (at least to ``needed``): amortized, a long generation copies each key O(1)
        times."""
        cap = max(needed, 2 * self.k_SHLD.shape[2])
        pad = (0, 0, 0, cap - self.k_SHLD.shape[2])
        self.k_SHLD, self.v_SHLD = F.pad(self.k_SHLD, pad), F.pad(self.v_SHLD, pad)


class DecodeCache:
    """The decoding state of S sequences across all decoder layers of one model.

    Create it empty, ``DecodeCache()``; the first ``Qwen3_5VLM.forward(..., cache=cache)`` is the prefill and fills
    it, every later call decodes one token per sequence. A call refused by the model's checks leaves it unchanged; a
    prefill that fails later is redone by the next call, a decode step that fails midway leaves it unusable. A new
    batch of prompts needs a new cache.
    """

    def __init__(self, reserve_tokens: int = RESERVE_TOKENS) -> None:
        self.reserve_tokens = reserve_tokens
        """Room each attention layer allocates beyond the longest prompt (e.g. the generation budget); more is
        allocated when needed, by doubling."""
        self.layers: list[LinearAttnCache | AttnCache] = []
        """One cache per decoder layer, in layer order (empty before the prefill)."""
        self.prompt_lengths: tuple[int, ...] = ()
        """Host ints: each sequence's prompt length (the prefill's segments, in order)."""
        self.steps = 0
        """Decode calls so far; each added one token to every sequence."""
        self.prefilled = False
        """True once a prefill completed: later calls decode."""

    @property
    def num_sequences(self) -> int:
        """S: the sequences of the prefill."""
        return len(self.prompt_lengths)

    def start(self, layer_types: Sequence[str], prompt_lengths: Sequence[int]) -> None:
        """Fresh, unfilled per-layer caches for a prefill of ``prompt_lengths`` (called by the model)."""
        self.layers = [
            LinearAttnCache() if kind == "linear_attention" else AttnCache(self.reserve_tokens) for kind in layer_types
        ]
        self.prompt_lengths, self.steps, self.prefilled = tuple(prompt_lengths), 0, False

    def check_step(self, input_ids: torch.Tensor, pixel_values, image_grid_thw, num_layers: int) -> None:
        """Refuse a decode call whose shapes do not continue this cache (before any layer changes it)."""
        S = self.num_sequences
        if tuple(input_ids.shape) != (S, 1):
            raise ValueError(
                f"decode step: input_ids must be [S, 1] = [{S}, 1] (one new token per prompt of the prefill, in its "
                f"segment order), got {tuple(input_ids.shape)}; a new batch of prompts needs a new DecodeCache()"
            )
        if pixel_values is not None or image_grid_thw is not None:
            raise ValueError(
                "decode step: pixel_values / image_grid_thw are given, but decode steps take text tokens only"
            )
        if len(self.layers) != num_layers:
            raise ValueError(f"this cache holds {len(self.layers)} layers but the model has {num_layers}")


def next_positions(position_ids: torch.Tensor, seq_lens: torch.Tensor | Sequence[int]) -> list[int]:
    """Host ints ``[S]``: the position of each segment's first generated token, its largest prompt position (over the
    three MRoPE axes) + 1, as transformers' Qwen3.5 continues after a (multimodal) prompt. Decode step ``i`` (from 0)
    of segment ``s`` is at ``next_positions[s] + i`` on all three axes (``decode_position_ids``).

    ``position_ids``: the prefill's ``[3, B, L]`` (or ``[3, T]``) positions; ``seq_lens``: its segment lengths. Reads
    the positions on the host (one copy when they are on a device).
    """
    pos_T = position_ids.reshape(3, -1).amax(0).cpu()
    lengths = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    if sum(lengths) != pos_T.numel() or min(lengths, default=0) <= 0:
        raise ValueError(f"seq_lens {lengths} must be positive and cover the {pos_T.numel()} positions")
    return [int(p.max()) + 1 for p in pos_T.split(lengths)]


def decode_position_ids(starts: Sequence[int], step: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[3, S, 1]`` int64 positions of decode step ``step`` (from 0): ``starts[s] + step`` on every axis, where
    ``starts`` is ``next_positions`` of the prefill."""
    pos_S = torch.tensor(starts, dtype=torch.int64) + step
    return pos_S.expand(3, -1)[..., None].to(device or "cpu")
