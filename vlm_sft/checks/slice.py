"""The packing self-check's model slice: a few layers of the (possibly FSDP2-sharded) model, never a copy of it.

The packing check (``vlm_sft.checks.packing_check``) compares a packed row with each of its samples alone, both
against a float64 reference of the same model. It is self-consistent: every number it judges comes from one model.
So it does not need the trained model's every layer; it needs every *token-mixing op* at the run's real widths,
kernels and precision. ``build_slice`` builds that model from the trained one:

- **layers**: the shortest prefix of ``text_config.layer_types`` holding every kind (Qwen3.5: three GatedDeltaNet
  layers and a full-attention layer), at the real head counts and widths: the depth ``RATIO_BOUND`` was calibrated
  at (with one GatedDeltaNet layer instead of three, a leaking conv measured a logits ratio of 17, against 21-45);
- **vision**: the first ``SLICE_VISION_BLOCKS`` blocks of the tower (patch embedding, positions and merger whole);
- **MLPs**, which mix no tokens: the first ``SLICE_MLP_WIDTH`` channels of a dense MLP or shared expert, and the
  first ``SLICE_EXPERTS`` routed experts (top-k clamped to half of them, so routing stays a choice);
- **vocabulary**: only the ids the checked rows use (and the pad id), renumbered ``0..n-1`` (``compact_vocab``,
  ``remap_ids``): the embedding and LM-head rows of those ids;
- the model's ``backends`` object, LoRA adapters (peft, the same config on the corresponding modules),
  ``requires_grad`` flags, dtypes (trainable float32, frozen in their stored dtype) and activation checkpointing.

Its weights are copied from the model by name. A DTensor parameter (FSDP2 shards dim 0 over the ranks,
``torch.chunk`` layout) is gathered with ``full_tensor()`` when the slice takes it whole; when it takes some rows
(vocabulary, experts) or a prefix of dim 1 (a narrowed MLP's ``down_proj``), each rank writes the part it owns into
a zero host tensor and one all-reduce sums them (exact: every element has one non-zero term). Both are collectives,
so every rank walks the slice's parameters in the same order; the slice itself lives on rank 0 only, the other
ranks' parts are freed as they go. A plain (unsharded) parameter is indexed directly.

Cost on rank 0 (float32 master weights; P = slice parameters): the slice (4 B each) and its float64 reference
(8 B), and while a sample is checked its float64 reference gradients (8 B) and one float32 set (4 B): 24 B per
trainable slice parameter, 12 B per frozen one, plus the checked rows' activations (``self_check.CHECK_SEQ_LEN``
caps a sample at 1024 tokens; with activation checkpointing, as the GPU configs run, about 1 GB at 9B widths).
From ``slice_shape`` on the real configs, the vision towers frozen as the shipped configs have them, for 4096
vocabulary ids (16 samples of at most 1024 tokens; each id costs 2 rows of the hidden width, 196 KB at 9B):

=======  ======  =================  ======  ================  ===========  ==============  ==================
model    params  slice: text + ViT  share   float64 copy      check, 24 B  4 S / W, W = 8  training, 8 S / W
=======  ======  =================  ======  ================  ===========  ==============  ==================
0.8B     0.85 B  49.5 M + 22.6 M    8.5 %   0.58 GB (6.8 GB)  1.5 GB       0.85 GB         1.7 GB
9B       9.41 B  320 M + 59.8 M     4.0 %   3.0 GB (75 GB)    8.4 GB       9.4 GB          19 GB
35B-A3B  35.1 B  259 M + 50.3 M     0.88 %  2.5 GB (281 GB)   6.8 GB       35.1 GB         70 GB
=======  ======  =================  ======  ================  ===========  ==============  ==================

(S = the checkpoint's bytes in bf16, W = ranks; float64 copy: the slice's, in brackets the whole model's that the
check made before.) The 35B-A3B slice: three GatedDeltaNet layers (16 key / 32 value heads of 128) and a
full-attention layer (16 query / 2 kv heads of 256) at hidden 2048, each with 8 routed experts of width 512 (top-4)
and the 512-wide shared expert, and one vision block of hidden 1152: 309 M parameters. At the check a rank holds its
2 S / W of float32 weights; in training 8 S / W (weights, gradients and AdamW state; the default fused AdamW step
adds no temporaries, ``foreach`` one more copy of the weights: 10 S / W) plus activations. So the check stays well
within 4 S / W for the 35B-A3B, at it for the 9B (8.4 GB and about 1 GB of activations), and over it for the 0.8B
at 8 ranks, about at that run's own peak without its activations (0.43 + 1.5 GB vs 1.7 GB).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from vlm_sft.model.moe import is_moe_text_config
from vlm_sft.model.vlm import Qwen3_5VLM
from vlm_sft.parallel.collectives import all_reduce, full_tensor
from vlm_sft.parallel.env import DistEnv
from vlm_sft.parallel.fsdp import is_sharded, local_rows, shard_ranks
from vlm_sft.parallel.parallelize import DECODER_LAYERS, INPUT_EMBEDDINGS, text_decoder

logger = logging.getLogger(__name__)

SLICE_VISION_BLOCKS = 1
"""Vision blocks the slice keeps: each block attends within one image only, so one block shows a leak across images."""
SLICE_EXPERTS = 8
"""Routed experts the slice keeps (the first ones). Experts are per-token MLPs: the count changes no token mixing."""
SLICE_MLP_WIDTH = 512
"""Channels kept of a dense MLP or shared expert (per-token, like the experts; 512 is the 35B-A3B's own width): 9B's
12288-wide MLPs are 70 % of its layers' parameters."""
VOCAB_PARAMS = (f"{INPUT_EMBEDDINGS}.weight", "lm_head.weight")
"""Parameters whose rows are vocabulary ids: the slice takes the rows of the ids in ``compact_vocab``."""
_LAYERS = f"{DECODER_LAYERS}."


@dataclass(frozen=True)
class SliceShape:
    """What ``build_slice`` keeps of the model (``slice_shape`` gives the defaults)."""

    layers: tuple[int, ...]
    """Source text layers, in order: slice layer ``j`` is the model's layer ``layers[j]``."""
    vision_blocks: int
    """The first vision blocks kept."""
    experts: int | None = None
    """MoE: the first routed experts kept (None for a dense model)."""
    top_k: int | None = None
    """MoE: experts per token in the slice."""
    mlp_width: int | None = None
    """Channels kept of a dense MLP (dense models) or of the shared expert (MoE); None keeps them all."""


def slice_shape(config, *, experts: int = SLICE_EXPERTS, mlp_width: int = SLICE_MLP_WIDTH) -> SliceShape:
    """The default slice of ``config``: the shortest prefix of layers with every kind, ``SLICE_VISION_BLOCKS``
    blocks, at most ``experts`` experts (top-k at most half of them) and ``mlp_width`` MLP channels."""
    text = config.text_config
    first: dict[str, int] = {}
    for i, kind in enumerate(text.layer_types[: text.num_hidden_layers]):
        first.setdefault(kind, i)
    layers = tuple(range(max(first.values()) + 1))
    vision = min(SLICE_VISION_BLOCKS, config.vision_config.depth)
    if not is_moe_text_config(text):
        return SliceShape(layers, vision, mlp_width=min(mlp_width, text.intermediate_size))
    kept = min(experts, text.num_experts)
    return SliceShape(
        layers,
        vision,
        experts=kept,
        top_k=min(text.num_experts_per_tok, max(1, kept // 2)),
        mlp_width=min(mlp_width, text.shared_expert_intermediate_size),
    )


def slice_config(config, shape: SliceShape, vocab_size: int, pad_id: int | None):
    """A copy of ``config`` cut to ``shape``, with a ``vocab_size`` vocabulary whose pad id is ``pad_id``."""
    out = copy.deepcopy(config)
    text = out.text_config
    text.layer_types = [text.layer_types[i] for i in shape.layers]
    text.num_hidden_layers = len(shape.layers)
    text.vocab_size = vocab_size
    text.pad_token_id = pad_id
    if is_moe_text_config(text):
        text.num_experts, text.num_experts_per_tok = shape.experts, shape.top_k
        text.shared_expert_intermediate_size = shape.mlp_width or text.shared_expert_intermediate_size
    elif shape.mlp_width:
        text.intermediate_size = shape.mlp_width
    out.vision_config.depth = shape.vision_blocks
    return out


def compact_vocab(token_ids: Iterable[torch.Tensor], extra: Iterable[int | None] = ()) -> torch.Tensor:
    """The sorted distinct ids (>= 0) of ``token_ids`` and ``extra``: the slice's vocabulary, id ``vocab[i]`` -> i."""
    parts = [t.reshape(-1).long().cpu() for t in token_ids]
    parts.append(torch.tensor([i for i in extra if i is not None], dtype=torch.long))
    ids = torch.cat(parts)
    return torch.unique(ids[ids >= 0])


def remap_ids(ids: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """``ids`` renumbered into the compact ``vocab`` (negative ids, e.g. ignored targets, stay as they are)."""
    pos = torch.searchsorted(vocab, ids.clamp(min=0))
    if bool((vocab[pos.clamp(max=len(vocab) - 1)] != ids)[ids >= 0].any()):
        raise ValueError("remap_ids: an id is missing from the compact vocabulary (build it from every checked row)")
    return torch.where(ids >= 0, pos, ids)


def _source_name(name: str, shape: SliceShape) -> str:
    """The model's parameter, buffer or module name of the slice's ``name`` (only text layer indexes differ)."""
    if not name.startswith(_LAYERS):
        return name
    index, dot, rest = name[len(_LAYERS) :].partition(".")
    return f"{_LAYERS}{shape.layers[int(index)]}{dot}{rest}"


def _skeleton(vlm: Qwen3_5VLM, config, shape: SliceShape) -> Qwen3_5VLM:
    """The slice's module tree on the meta device, with the model's backends and, if it has them, LoRA adapters on
    the modules that correspond to its adapted ones (peft, the model's own LoRA config)."""
    checkpointing = text_decoder(vlm).activation_checkpointing
    with torch.device("meta"):
        out = Qwen3_5VLM(config, vlm.backends, activation_checkpointing=checkpointing)
    peft_config = getattr(vlm, "peft_config", None)
    if any(".lora_A." in n for n, _ in vlm.named_parameters()):
        if not peft_config:
            raise TypeError("the model has LoRA adapters but no peft_config (attach them with model.lora.attach_lora)")
        from peft import inject_adapter_in_model

        from vlm_sft.model.lora import ADAPTER_NAME

        # The adapted modules by what they are (peft may have shortened the config's names to suffixes).
        adapted = {n for n, m in vlm.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}
        targets = [n for n, m in out.named_modules() if isinstance(m, nn.Linear) and _source_name(n, shape) in adapted]
        with torch.device("meta"):
            inject_adapter_in_model(dataclasses.replace(peft_config[ADAPTER_NAME], target_modules=targets), out)
    out.train(vlm.training)
    return out


def _shard_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's local tensor of ``param`` and the index of its first row in the whole tensor (dim 0)."""
    try:
        local, offset, _ = local_rows(param)
    except NotImplementedError as err:
        raise NotImplementedError(
            f"the packing self-check's slice reads parameters sharded on dim 0 alone ({err}): run the "
            "check before other parallelisms, or set train.check_packing = false"
        ) from err
    return local, offset


def _take(param: torch.Tensor, rows: torch.Tensor | None, size: torch.Size, env: DistEnv, keep: bool):
    """Rows ``rows`` of ``param`` (None: the first ``size[0]``) narrowed to ``size``'s other dims, a new tensor on
    ``param``'s device; None where ``keep`` is False (a contributing rank). A DTensor is gathered (collective)."""
    whole = rows is None and tuple(size) == tuple(param.shape)
    if not is_sharded(param):  # every rank holds all of it: no collective
        part = param.detach() if rows is None else param.detach()[rows.to(param.device)]
        for dim in range(len(size)):
            part = part.narrow(dim, 0, size[dim])
        return part.clone() if keep else None
    if whole:
        full = full_tensor(param)
        return full if keep else None
    rows = torch.arange(size[0]) if rows is None else rows
    local, offset = _shard_rows(param)
    mine = (rows >= offset) & (rows < offset + local.shape[0])
    part = local[(rows[mine] - offset).to(local.device)]
    for dim in range(1, len(size)):
        part = part.narrow(dim, 0, size[dim])
    # Summed in float32 (exact: one non-zero term per element), which gloo reduces for every parameter dtype.
    out = torch.zeros(size, dtype=torch.float32)
    out[mine] = part.float().cpu()
    del part, local
    out = all_reduce(out, env).to(param.dtype)
    return out.to(param.device) if keep else None


def _rows_of(name: str, src: torch.Tensor, size: torch.Size, vocab: torch.Tensor) -> torch.Tensor | None:
    """The rows of ``src`` the slice parameter ``name`` of ``size`` takes: the vocabulary's ids, else a prefix."""
    assert len(size) == src.dim() and all(s <= t for s, t in zip(size, src.shape, strict=True)), (name, size, src.shape)
    assert all(s == t for s, t in zip(size[2:], src.shape[2:], strict=True)), f"{name}: only dims 0 and 1 narrow"
    return vocab if name in VOCAB_PARAMS else None


def build_slice(
    model: nn.Module, vocab: torch.Tensor, env: DistEnv | None = None, shape: SliceShape | None = None
) -> Qwen3_5VLM | None:
    """The check's slice of ``model`` (see the module docstring) on rank 0; None on the other ranks.

    ``model`` is a ``Qwen3_5VLM``, FSDP2-sharded or not; ``vocab`` the compact vocabulary (``compact_vocab``, the
    same on every rank); ``shape`` defaults to ``slice_shape(model.config)``. Every rank must call it when the model
    is sharded (its gathers are collectives); an unsharded model needs no collective.
    """
    vlm = next((m for m in model.modules() if isinstance(m, Qwen3_5VLM)), None)
    if vlm is None:
        raise TypeError(f"build_slice needs a Qwen3_5VLM (or a module holding one), got {type(model).__name__}")
    env = env or DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    shape = shape or slice_shape(vlm.config)
    pad = vlm.config.text_config.pad_token_id
    vocab = vocab.long().cpu()
    new_pad = None if pad is None else int(remap_ids(torch.tensor([pad]), vocab))
    out = _skeleton(vlm, slice_config(vlm.config, shape, len(vocab), new_pad), shape)
    sources = dict(vlm.named_parameters())
    if any(shard_ranks(p) > 1 for p in sources.values()) and not env.distributed:
        raise ValueError("build_slice: the model is sharded over several ranks; pass the run's DistEnv, on every rank")
    keep = env.is_main
    filled: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for name, p in out.named_parameters():  # the same order on every rank: the gathers pair up
            src = sources[_source_name(name, shape)]
            value = _take(src, _rows_of(name, src, p.shape, vocab), p.shape, env, keep)
            if keep:
                filled[id(p)] = nn.Parameter(value, requires_grad=src.requires_grad)
    if not keep:
        return None
    for name, p in list(out.named_parameters(remove_duplicate=False)):  # tied weights stay one parameter
        owner, leaf = name.rsplit(".", 1)
        out.get_submodule(owner)._parameters[leaf] = filled[id(p)]
    buffers = dict(vlm.named_buffers())
    for name, _ in list(out.named_buffers()):
        owner, leaf = name.rsplit(".", 1)
        out.get_submodule(owner)._buffers[leaf] = buffers[_source_name(name, shape)].detach().clone()
    meta = [n for n, t in [*out.named_parameters(), *out.named_buffers()] if t.is_meta]
    assert not meta, f"slice tensors left on the meta device: {meta}"
    kept, total = parameter_count(out), parameter_count(vlm)
    logger.info(
        "packing self-check slice: text layers %s, %d vision block(s), %d vocabulary ids: %.1f M parameters "
        "(%.2f%% of the model)", list(shape.layers), shape.vision_blocks, len(vocab), kept / 1e6, 100 * kept / total,
    )  # fmt: skip
    return out


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters' elements (a DTensor counts its whole shape): what the module docstring's table counts."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "SLICE_EXPERTS",
    "SLICE_MLP_WIDTH",
    "SLICE_VISION_BLOCKS",
    "SliceShape",
    "build_slice",
    "compact_vocab",
    "parameter_count",
    "remap_ids",
    "slice_config",
    "slice_shape",
]
