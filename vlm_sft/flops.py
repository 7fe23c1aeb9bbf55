"""FLOPs of one training step, counted from the actual packed batch, and MFU where the peak rate is known.

Why a model of our own: the usual ``6 * params * tokens`` hides exactly what packing changes. Full attention costs
``s^2`` per *segment*, so a row of ten 400-token samples costs a tenth of one 4000-token sample; padding tokens cost
time but teach nothing; and the vision tower's cost depends on the images, not on the text length. So the count here
walks the batch: its segments, its images, its real tokens.

Conventions (one multiply-add = 2 FLOPs; elementwise work, norms, rotary, softmax, activations and the optimizer are
not counted, as in the common MFU accounting):

- **Text, per token**: every projection of every layer (full attention: q with its output gate, k, v, o; GatedDeltaNet:
  in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj), the MLP (gate, up, down), the depthwise short conv
  (``2 * W`` per channel), and the LM head (``2 * D * V``, computed for every real token, as the chunked loss does).
- **MoE MLP, per token** (Qwen3.5-MoE, ``moe.SparseMoeBlock``): the router (``2 * D * E``: every token scores every
  expert), the ``k`` experts the token is routed to (``k * 2 * 3 * D * I_e``), the shared expert (``2 * 3 * D * I_s``)
  and its sigmoid gate (``2 * D``). Never all ``E`` experts: the other ``E - k`` hold weights but do no work for the
  token, and the sorted / grouped expert kernels run exactly the ``T * k`` routed token slots (no capacity padding,
  no dropped tokens). Counting all experts would put the 35B-A3B shape at 68.3 GFLOP per token instead of 5.9
  (projections, MLPs, conv and LM head, forward) and inflate its MFU 11.6-fold.
- **Full attention, per segment** of ``s`` tokens: causal, only the ``s (s + 1) / 2`` query-key pairs that exist,
  times ``4 * heads * head_dim`` (scores and weighted values); never ``L^2`` of the row.
- **GatedDeltaNet, per segment**: the chunked algorithm with chunks of ``GDN_CHUNK`` tokens (the last one partial);
  per chunk of ``c`` tokens and per value head: ``q k^T`` and ``k k^T`` (``2 c^2 K`` each), the unit-triangular
  solve for ``[u, w]`` (``c^2 (V + K)``), ``attn @ u`` (``2 c^2 V``), ``attn @ w`` (``2 c^2 K``), the two state reads
  ``[q; w] @ S`` (``4 c K V``, not for a segment's first chunk, whose state is zero) and the state update
  (``2 c K V``, not after a segment's last chunk).
- **Vision tower, per image** of ``n = t h w`` patches: the patch embedding (``2 * C T P^2 * hidden`` per patch), per
  block qkv / proj / MLP per patch plus bidirectional attention over the image's own patches (``4 n^2 hidden``), and
  the patch merger per merged token.
- **Training step = forward x 3** (forward once, backward twice: input and weight gradients) for the text model and
  the LM head; the vision tower counts x 3 when it trains and x 1 when frozen (no gradient flows into it at all).
- **Useful vs executed**: ``batch_flops(..., count_padding=False)`` (the default, and what MFU uses) counts real
  tokens and real segments only; ``count_padding=True`` counts what the kernels run: padded ``stack`` rows as whole
  ``L``-token segments, the padding segment of a packed row, and the dummy image of a batch without images.

Legend: D hidden, I MLP width, V vocabulary, K / V key / value head dims, W conv width, s segment length, n patches;
MoE: E experts, k experts per token, I_e routed-expert width, I_s shared-expert width.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import Qwen3_5Config, Qwen3_5MoeConfig

from vlm_sft.data.batch import PackedBatch
from vlm_sft.model.moe import is_moe_text_config

logger = logging.getLogger(__name__)

GDN_CHUNK = 64
"""Chunk length of the counted GatedDeltaNet algorithm (flash-linear-attention's and our torch kernel's default)."""

PEAK_BF16_DENSE_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)
"""Dense (no sparsity) bf16 tensor-core peaks from the vendor data sheets, matched in order as substrings of
``torch.cuda.get_device_name()`` (so ``H100 PCIe`` is tried before the SXM ``H100``, ``L40S`` before ``L4``)."""


@dataclass(frozen=True)
class FlopCount:
    """Forward FLOPs of one batch by part; ``train`` applies the forward x 3 convention (module docstring)."""

    dense: float
    """Text projections and MLPs of every layer over the counted tokens (MoE: router, active experts, shared expert)."""
    attention: float
    """Full-attention scores and weighted values, causal, per segment."""
    linear_attention: float
    """GatedDeltaNet chunked rule, per segment."""
    conv: float
    """Depthwise short conv of the GatedDeltaNet layers."""
    lm_head: float
    """Vocabulary projection of every counted token (the loss computes it for all of them)."""
    vision: float
    """Vision tower forward on the batch's images."""
    vision_trainable: bool
    """Whether the vision tower trains (its backward counts) or is frozen (forward only)."""
    tokens: int
    """Text tokens counted (real tokens, or every row slot with ``count_padding``)."""
    patches: int
    """Vision patch rows counted."""

    @property
    def text_forward(self) -> float:
        return self.dense + self.attention + self.linear_attention + self.conv + self.lm_head

    @property
    def forward(self) -> float:
        return self.text_forward + self.vision

    @property
    def train(self) -> float:
        """FLOPs of forward + backward: text and LM head x 3, vision x 3 when it trains, x 1 when frozen."""
        return 3.0 * self.text_forward + (3.0 if self.vision_trainable else 1.0) * self.vision

    def __add__(self, other: FlopCount) -> FlopCount:
        if self.vision_trainable != other.vision_trainable:
            raise ValueError("cannot add FLOP counts of a frozen and a trainable vision tower")
        summed = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in dataclasses.fields(self)
            if f.name != "vision_trainable"
        }
        return FlopCount(vision_trainable=self.vision_trainable, **summed)


# ------------------------------------------------------------------------------------------------ text model


def _layer_counts(text) -> tuple[int, int]:
    types = list(text.layer_types)
    return types.count("linear_attention"), types.count("full_attention")


def _head_dim(text) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def dense_flops_per_token(text) -> float:
    """Forward FLOPs of every text projection and MLP for one token (not the LM head, conv or token mixing).

    The MLP term is ``mlp_flops_per_token``: for an MoE text config, the active experts only.
    """
    d = text.hidden_size
    n_linear, n_full = _layer_counts(text)
    key_dim = text.linear_num_key_heads * text.linear_key_head_dim
    value_dim = text.linear_num_value_heads * text.linear_value_head_dim
    gdn = d * (2 * key_dim + value_dim) + d * value_dim + 2 * d * text.linear_num_value_heads + value_dim * d
    hd = _head_dim(text)
    q_out = text.num_attention_heads * hd
    attn = d * 2 * q_out + 2 * d * text.num_key_value_heads * hd + q_out * d  # q (+ gate), k, v, o
    return 2.0 * (n_linear * gdn + n_full * attn) + text.num_hidden_layers * mlp_flops_per_token(text)


def mlp_flops_per_token(text) -> float:
    """Forward FLOPs of one layer's MLP for one token: the dense SwiGLU (``2 * 3 * D * I``), or for a Qwen3.5-MoE text
    config the work the token actually causes: router ``2 * D * E``, its ``k`` routed experts ``k * 2 * 3 * D * I_e``,
    the shared expert ``2 * 3 * D * I_s`` and the shared expert's gate ``2 * D`` (module docstring: never all E)."""
    d = text.hidden_size
    if not is_moe_text_config(text):
        return 2.0 * 3 * d * text.intermediate_size
    router = d * text.num_experts
    routed = text.num_experts_per_tok * 3 * d * text.moe_intermediate_size
    shared = 3 * d * text.shared_expert_intermediate_size + d  # SwiGLU + its one-output sigmoid gate
    return 2.0 * (router + routed + shared)


def conv_flops_per_token(text) -> float:
    n_linear, _ = _layer_counts(text)
    conv_dim = 2 * text.linear_num_key_heads * text.linear_key_head_dim
    conv_dim += text.linear_num_value_heads * text.linear_value_head_dim
    return 2.0 * n_linear * conv_dim * text.linear_conv_kernel_dim


def lm_head_flops_per_token(text) -> float:
    return 2.0 * text.hidden_size * text.vocab_size


def attention_flops(text, segment_lengths: Sequence[int]) -> float:
    """Causal full attention over all full-attention layers: ``4 * H * head_dim * s (s + 1) / 2`` per segment."""
    _, n_full = _layer_counts(text)
    pairs = sum(s * (s + 1) // 2 for s in segment_lengths)
    return 4.0 * n_full * text.num_attention_heads * _head_dim(text) * pairs


def gdn_segment_flops(length: int, *, key_dim: int, value_dim: int, chunk: int = GDN_CHUNK) -> float:
    """One value head of the chunked gated delta rule over one segment of ``length`` tokens (module docstring)."""
    if length <= 0:
        return 0.0
    k, v = key_dim, value_dim
    full, rest = divmod(length, chunk)
    sizes = [chunk] * full + ([rest] if rest else [])
    total = 0.0
    for j, c in enumerate(sizes):
        total += c * c * (2 * k + 2 * k + (v + k) + 2 * v + 2 * k)  # qk^T, kk^T, solve, attn@u, attn@w
        if j > 0:
            total += 4 * c * k * v  # [q; w] @ S
        if j < len(sizes) - 1:
            total += 2 * c * k * v  # S += k_dec^T @ v_new
    return total


def linear_attention_flops(text, segment_lengths: Sequence[int], *, chunk: int = GDN_CHUNK) -> float:
    """The GatedDeltaNet rule over all linear-attention layers (key heads repeated to the value heads, as run)."""
    n_linear, _ = _layer_counts(text)
    per_head = sum(
        gdn_segment_flops(s, key_dim=text.linear_key_head_dim, value_dim=text.linear_value_head_dim, chunk=chunk)
        for s in segment_lengths
    )
    return n_linear * text.linear_num_value_heads * per_head


# ------------------------------------------------------------------------------------------------ vision tower


def vision_image_flops(vision, t: int, h: int, w: int) -> float:
    """Vision tower forward for one image of ``t x h x w`` patches: embedding, blocks (own-image attention), merger."""
    n = t * h * w
    hidden, inter = vision.hidden_size, vision.intermediate_size
    patch_in = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    embed = 2.0 * n * patch_in * hidden
    per_patch_block = 2.0 * (hidden * 3 * hidden + hidden * hidden + 2 * hidden * inter)
    blocks = vision.depth * (n * per_patch_block + 4.0 * n * n * hidden)
    unit = vision.spatial_merge_size**2
    merged = n // unit
    merger = 2.0 * merged * ((unit * hidden) ** 2 + unit * hidden * vision.out_hidden_size)
    return embed + blocks + merger


def vision_flops(vision, image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None) -> float:
    if image_grid_thw is None:
        return 0.0
    grids = image_grid_thw.tolist() if isinstance(image_grid_thw, torch.Tensor) else image_grid_thw
    return sum(vision_image_flops(vision, int(t), int(h), int(w)) for t, h, w in grids)


# ------------------------------------------------------------------------------------------------ batches


def real_segment_lengths(batch: PackedBatch) -> list[int]:
    """Lengths of the batch's samples (its segments without padding), in row order."""
    b, length = batch.shape
    if batch.seq_lens is None:
        return [int(n) for n in batch.attention_mask.sum(-1).tolist() if n > 0]
    segs = batch.seq_lens.tolist()
    out: list[int] = []
    pos = 0
    for row in range(b):
        n_samples = len(batch.sample_indices[row])
        real = segs[pos : pos + n_samples]
        pos += n_samples
        out.extend(real)
        if sum(real) < length:  # the collator's padding segment closes the row
            assert segs[pos] == length - sum(real), "padding segment does not close its row"
            pos += 1
    assert pos == len(segs), "segments left over after the last row"
    return out


def executed_segment_lengths(batch: PackedBatch) -> list[int]:
    """Segments as the kernels run them: packed rows' ``seq_lens`` (padding included), ``stack`` rows whole."""
    b, length = batch.shape
    return [length] * b if batch.seq_lens is None else [int(s) for s in batch.seq_lens.tolist()]


def batch_flops(
    batch: PackedBatch, config: Qwen3_5Config | Qwen3_5MoeConfig, *, vision_trainable: bool, count_padding: bool = False
) -> FlopCount:
    """FLOPs of one micro-batch (module docstring); ``count_padding`` counts the executed work instead of the useful."""
    text, vision = config.text_config, config.vision_config
    if count_padding:
        segments = executed_segment_lengths(batch)
        tokens = batch.input_ids.numel()
        grid = batch.image_grid_thw
        if grid is None:  # the model runs its dummy image to keep the tower in the graph
            m = vision.spatial_merge_size
            grid = [[1, m, m]]
    else:
        segments = real_segment_lengths(batch)
        tokens = batch.num_real_tokens
        grid = batch.image_grid_thw
    patches = 0 if grid is None else sum(int(t) * int(h) * int(w) for t, h, w in _rows(grid))
    return FlopCount(
        dense=dense_flops_per_token(text) * tokens,
        attention=attention_flops(text, segments),
        linear_attention=linear_attention_flops(text, segments),
        conv=conv_flops_per_token(text) * tokens,
        lm_head=lm_head_flops_per_token(text) * tokens,
        vision=vision_flops(vision, grid),
        vision_trainable=vision_trainable,
        tokens=tokens,
        patches=patches,
    )


def _rows(grid) -> list:
    return grid.tolist() if isinstance(grid, torch.Tensor) else list(grid)


# ------------------------------------------------------------------------------------------------ MFU


def peak_flops(device: torch.device | str, dtype: torch.dtype | None) -> float | None:
    """Dense peak FLOP/s of one device for ``dtype``, or None where unknown (CPUs, fp32, GPUs not in the table)."""
    device = torch.device(device)
    if device.type != "cuda" or dtype != torch.bfloat16 or not torch.cuda.is_available():
        return None
    return peak_for_name(torch.cuda.get_device_name(device))


def peak_for_name(device_name: str) -> float | None:
    """bf16 dense peak for a CUDA device name (``PEAK_BF16_DENSE_FLOPS``), None when it is not in the table."""
    for key, peak in PEAK_BF16_DENSE_FLOPS:
        if key in device_name:
            return peak
    return None


def mfu(flops: float, seconds: float, peak: float | None, num_devices: int = 1) -> float | None:
    """Model FLOPs utilization: useful FLOPs / (seconds x peak x devices); None without a known peak."""
    if peak is None or seconds <= 0:
        return None
    return flops / (seconds * peak * num_devices)
