"""``Qwen3_5VLM``: transformers' Qwen3.5 vision tower + our packed-training text decoder, HF-compatible.

The module tree and parameter names equal transformers' ``Qwen3_5ForConditionalGeneration`` (``model.visual.*``
is their ``Qwen3_5VisionModel`` unchanged, ``model.language_model.*`` is ``Qwen3_5TextDecoder``, plus
``lm_head.weight``), so Hugging Face checkpoints load and save without renaming. A ``Qwen3_5MoeConfig`` builds the
MoE family the same way (``Qwen3_5MoeForConditionalGeneration``'s names: ``Qwen3_5MoeVisionModel``, a
``moe.SparseMoeBlock`` MLP per layer); its checkpoints hold per-expert keys on disk (see ``vlm_sft.checkpoint.hf_dir``).

Forward layout: ``input_ids`` ``[B, L]`` is flattened row-major to T = B * L tokens; ``seq_lens`` splits them
into segments (samples and padding) that never see each other. The vision tower runs exactly once per forward,
on a dummy image when the batch has none, so every FSDP rank issues the same collectives and a trainable tower
always gets a (zero) gradient.

Generation (eval) passes a ``decode.DecodeCache``: a prefill of packed prompts, then one token per sequence per call,
without a full forward per token (``decode``'s docstring).

Legend: B = rows, L = row length, T = B * L tokens, D = hidden size, V = vocab, P = patch rows, N = images.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import Qwen3_5Config, Qwen3_5MoeConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

from renderers.types import TEXT_TOKEN_TYPE, VISION_TOKEN_TYPES
from vlm_sft.model.backends import Backends, resolve_backends
from vlm_sft.model.decode import DecodeCache
from vlm_sft.model.layers import init_text_weights
from vlm_sft.model.load_balance import RouterStats, router_stats
from vlm_sft.model.loss import TokenScores, chunked_cross_entropy, token_scores
from vlm_sft.model.moe import check_grouped_mm_widths, init_moe_weights, is_moe_text_config
from vlm_sft.model.sequence_split import WHOLE_ROW, SequenceSplit, split_images
from vlm_sft.model.text_model import Qwen3_5TextDecoder
from vlm_sft.model.varlen import Segments
from vlm_sft.model.vision import speed_up_vision_tower

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossOutput:
    """What ``Qwen3_5VLM.forward`` returns when targets are given; unpacks as ``loss_sum, num_tokens``."""

    loss_sum: torch.Tensor
    """Scalar float32: sum of the token cross-entropies over ``loss_mask`` (normalize by the global count)."""
    num_tokens: torch.Tensor
    """Scalar: number of tokens in ``loss_mask`` (the loss op's count)."""
    router: RouterStats | None = None
    """MoE models: the forward's router sums over its real tokens (for the load-balancing loss and the metrics)."""

    def __iter__(self):
        return iter((self.loss_sum, self.num_tokens))


class _Qwen3_5Core(nn.Module):
    """Holds ``visual`` and ``language_model`` under ``model.`` so parameter names match transformers."""

    def __init__(self, config: Qwen3_5Config | Qwen3_5MoeConfig) -> None:
        super().__init__()
        vision_cls = Qwen3_5MoeVisionModel if isinstance(config, Qwen3_5MoeConfig) else Qwen3_5VisionModel
        self.visual = speed_up_vision_tower(vision_cls._from_config(config.vision_config))
        self.language_model = Qwen3_5TextDecoder(config.text_config)


class Qwen3_5VLM(nn.Module):
    """Qwen3.5 vision-language model for packed SFT; see the module docstring for the layout.

    Build with ``build_model`` (random init) or ``vlm_sft.checkpoint.from_pretrained`` (HF checkpoint); both resolve
    the op backends once for the target device and store them on ``backends``. The model reads and writes no files:
    checkpoints are ``vlm_sft.checkpoint``'s.
    """

    def __init__(
        self,
        config: Qwen3_5Config | Qwen3_5MoeConfig,
        backends: Backends,
        *,
        freeze_vision: bool = True,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.backends = backends
        """The op implementations every forward uses (chosen once, by ``resolve_backends``)."""
        text = config.text_config
        if is_moe_text_config(text) and backends.experts == "grouped_mm":  # fail at build, not at the first forward
            check_grouped_mm_widths(text.hidden_size, text.moe_intermediate_size)
        self.model = _Qwen3_5Core(config)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tie_weights()
        self.set_activation_checkpointing(activation_checkpointing)
        self.set_vision_trainable(not freeze_vision)
        self.context_parallel: SequenceSplit = WHOLE_ROW
        """How every forward's row is split over ranks: ``WHOLE_ROW``, or under context parallelism this rank's CP
        group, each rank computing the loss of its ``1 / size`` of the tokens. Set only by
        ``vlm_sft.parallel.parallelize.apply_context_parallel``, which also wraps the token mixers."""

    # ----------------------------------------------------------------------------------------- configuration

    @property
    def tied_embeddings(self) -> bool:
        """True when ``lm_head`` shares the input embedding (``config.tie_word_embeddings``, as transformers)."""
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def tie_weights(self) -> None:
        if self.tied_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each text decoder layer in backward (non-reentrant ``torch.utils.checkpoint``)."""
        self.model.language_model.activation_checkpointing = bool(enabled)

    def set_vision_trainable(self, trainable: bool) -> None:
        """Freeze (default) or unfreeze the whole vision tower."""
        for p in self.model.visual.parameters():
            p.requires_grad_(trainable)

    @property
    def vision_trainable(self) -> bool:
        return any(p.requires_grad for p in self.model.visual.parameters())

    # ----------------------------------------------------------------------------------------------- forward

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | Sequence[int] | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        target_ids: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        scores: bool = False,
        router_mask: torch.Tensor | None = None,
        router_probs_grad: bool = False,
        routing_only: bool = False,
        cache: DecodeCache | None = None,
    ) -> torch.Tensor | LossOutput | TokenScores | RouterStats:
        """Logits ``[B, L, V]``; with ``target_ids``, ``LossOutput(loss_sum, num_tokens)``, or with ``scores=True``
        ``TokenScores`` (per-token loss and argmax, chunk by chunk: never the whole fp32 logits).

        ``position_ids`` (required): ``[3, B, L]`` MRoPE positions numbered per segment, built on the CPU by the data
        pipeline (``PackedBatch.position_ids``; ``vlm_sft.data.mrope.sample_position_ids`` for one sample): the model
        never rebuilds them. ``seq_lens``: segment lengths covering the B * L tokens row-major (each row's segments
        sum to L; padding is its own segment) as host ints (a CPU tensor or a sequence); None means one segment per
        row. ``pixel_values`` ``[P, C*T*p*p]`` and ``image_grid_thw`` ``[N, 3]``: the vision items (images and video
        groups, ``renderers.types``) in the order of their slots in the flattened tokens; slots are where
        ``mm_token_type_ids`` is 1 (image) or 2 (video). ``loss_mask`` (default:
        ``target_ids >= 0``) selects the tokens of the loss.

        MoE models also report ``LossOutput.router`` (``load_balance.RouterStats``) over the tokens of
        ``router_mask`` (``[B, L]`` bool, the real tokens: ``PackedBatch.real_mask``; None: every token), with the
        router probabilities in the autograd graph when ``router_probs_grad``. ``routing_only=True`` returns just
        those statistics and skips the LM head (the trainer's routing pre-pass).

        ``cache`` (generation, under ``torch.no_grad()``, without context parallelism): a ``decode.DecodeCache``. The
        first call with it prefills (the inputs above; returns the logits of every segment's last token ``[S, V]``),
        every later one decodes one token per sequence (``input_ids`` ``[S, 1]``, ``position_ids`` ``[3, S, 1]``, no
        images; logits ``[S, V]``). Targets, scores and routing are refused with it.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
        B, L = input_ids.shape
        segments = self._segments(seq_lens, B, L, input_ids.device)
        if loss_mask is None and target_ids is not None:
            loss_mask = target_ids >= 0
        _check_shapes(input_ids, position_ids, mm_token_type_ids, target_ids, loss_mask, router_mask)
        if cache is not None:
            unsupported = dict(target_ids=target_ids, loss_mask=loss_mask, scores=scores, router_mask=router_mask)
            unsupported |= dict(router_probs_grad=router_probs_grad, routing_only=routing_only)
            images = (pixel_values, image_grid_thw, mm_token_type_ids)
            return self._cached_logits(cache, input_ids, position_ids, segments, *images, unsupported)
        cp = self.context_parallel
        local = cp.shard if cp.active else (lambda x, dim=0: x)  # under CP: this rank's tokens of the row
        mm_T = None if mm_token_type_ids is None else mm_token_type_ids.reshape(-1)
        embeds_TD = self.model.language_model.embed_tokens(input_ids.reshape(-1))
        embeds_TD = self._merge_vision(embeds_TD, pixel_values, image_grid_thw, mm_T)
        hidden_TD, router_logits = self.model.language_model(
            local(embeds_TD), local(position_ids.reshape(3, -1), dim=1), segments, self.backends
        )
        router_T = None if router_mask is None else local(router_mask.reshape(-1))
        router = self._router_stats(router_logits, router_T, router_probs_grad)
        if routing_only:
            if router is None:
                raise ValueError("routing_only=True needs an MoE model (this one has no router)")
            return router
        if target_ids is None:
            if scores:
                raise ValueError("scores=True needs target_ids (and optionally loss_mask)")
            logits = self.lm_head(hidden_TD)
            return logits if cp.active else logits.view(B, L, -1)
        targets_T, mask_T = local(target_ids.reshape(-1)), local(loss_mask.reshape(-1))
        if scores:
            if cp.active:
                raise NotImplementedError("scores=True under context parallelism: score with a model without it")
            nll_T, argmax_T = token_scores(hidden_TD, self.lm_head.weight, targets_T, mask_T)
            return TokenScores(nll=nll_T.view(B, L), argmax=argmax_T.view(B, L))
        loss_sum, count = chunked_cross_entropy(
            hidden_TD, self.lm_head.weight, targets_T, mask_T, backend=self.backends.loss
        )
        return LossOutput(loss_sum=loss_sum, num_tokens=count, router=router)

    def _cached_logits(
        self,
        cache: DecodeCache,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        segments: Segments,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        mm_token_type_ids: torch.Tensor | None,
        unsupported: dict[str, object],
    ) -> torch.Tensor:
        """``forward`` with a cache (the inputs already checked there): prefill or decode, logits ``[S, V]``.

        ``unsupported``: the forward's other arguments by name; any that is set (not None / False) is refused.
        """
        given = [name for name, value in unsupported.items() if value is not None and value is not False]
        if given:
            raise ValueError(f"forward(cache=...) returns next-token logits only; drop {', '.join(given)}")
        if self.context_parallel.active:
            raise ValueError(
                "forward(cache=...) under context parallelism: generate with context parallelism off: "
                "apply_context_parallel(model, NO_CP) or `with context_parallel_off(model):` "
                "(vlm_sft.parallel.context_parallel)"
            )
        if torch.is_grad_enabled():
            raise ValueError(
                "forward(cache=...) with autograd on: the cache would keep every step's graph alive; generate under "
                "torch.no_grad()"
            )
        text = self.model.language_model
        if cache.prefilled:
            cache.check_step(input_ids, pixel_values, image_grid_thw, len(text.layers))
            embeds_TD = text.embed_tokens(input_ids.reshape(-1))  # decode tokens are text: the tower does not run
        else:
            mm_T = None if mm_token_type_ids is None else mm_token_type_ids.reshape(-1)
            embeds_TD = self._merge_vision(text.embed_tokens(input_ids.reshape(-1)), pixel_values, image_grid_thw, mm_T)
            cache.start([layer.layer_type for layer in text.layers], segments.lengths)
        hidden_TD, _ = text(embeds_TD, position_ids.reshape(3, -1), segments, self.backends, cache)
        if cache.prefilled:
            cache.steps += 1
            return self.lm_head(hidden_TD)
        last_S = torch.tensor(segments.lengths).cumsum(0).sub(1).to(hidden_TD.device)
        logits_SV = self.lm_head(hidden_TD.index_select(0, last_S))
        cache.prefilled = True
        return logits_SV

    def _router_stats(self, logits: list[torch.Tensor], mask_T: torch.Tensor | None, probs_grad: bool):
        if not logits:
            return None
        top_k = self.config.text_config.num_experts_per_tok
        return router_stats(logits, mask_T, top_k, probs_grad=probs_grad)

    @staticmethod
    def _segments(seq_lens: torch.Tensor | Sequence[int] | None, B: int, L: int, device: torch.device) -> Segments:
        """The forward's one segment layout, from host ints, checked to cover every row exactly (no device sync)."""
        segments = Segments.from_lengths((L,) * B if seq_lens is None else seq_lens, device)
        lengths = segments.lengths
        if not lengths or min(lengths) <= 0:
            raise ValueError(f"seq_lens must be non-empty and positive, got {list(lengths)}")
        ends = set(itertools.accumulate(lengths))
        if segments.total != B * L or not all(r * L in ends for r in range(1, B + 1)):
            raise ValueError(
                f"seq_lens {list(lengths)} must cover the {B} rows of length {L} row by row "
                f"(sum {segments.total} vs {B * L}; every row boundary must be a segment boundary)"
            )
        return segments

    def _merge_vision(
        self,
        embeds_TD: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        mm_T: torch.Tensor | None,
    ) -> torch.Tensor:
        """Runs the vision tower once (a dummy image when there is none) and scatters features into image slots.

        The checks read the device once (slot count, unsupported token types and the grids' patch count together)
        and the slot positions once: two host syncs per forward, whatever the number of layers.
        """
        if (pixel_values is None) != (image_grid_thw is None):
            raise ValueError("pixel_values and image_grid_thw must be given together")
        visual = self.model.visual
        dummy = pixel_values is None
        if dummy:
            image_grid_thw, pixel_values = self._dummy_image(embeds_TD.device)
        n_slots, n_bad, n_patches = self._count_inputs(mm_T, image_grid_thw)
        if n_bad:
            raise ValueError(f"mm_token_type_ids holds {n_bad} values other than 0 (text), 1 (image) and 2 (video)")
        if pixel_values.shape[0] != n_patches:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} patch rows but image_grid_thw {image_grid_thw.tolist()} "
                f"needs {n_patches}"
            )
        pixel_values = pixel_values.to(visual.dtype)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.vision_trainable):
            if self.context_parallel.active and not dummy:
                feats_ND = self._encode_share(pixel_values, image_grid_thw)
            else:
                feats_ND = visual(pixel_values, grid_thw=image_grid_thw).pooler_output
        feats_ND = feats_ND.to(embeds_TD.dtype)
        if dummy:
            if n_slots:
                raise ValueError(
                    f"mm_token_type_ids marks {n_slots} image slots but no pixel_values were given (0 image features)"
                )
            # Keeps the tower in the autograd graph (zero gradient) without changing any value.
            return embeds_TD + feats_ND.sum() * 0.0
        if mm_T is None:
            raise ValueError("pixel_values were given without mm_token_type_ids: it says which tokens are image slots")
        if n_slots != feats_ND.shape[0]:
            raise ValueError(
                f"image slot count mismatch: mm_token_type_ids marks {n_slots} image slots but the vision tower "
                f"produced {feats_ND.shape[0]} features for image_grid_thw {image_grid_thw.tolist()}"
            )
        slots = (mm_T != TEXT_TOKEN_TYPE).nonzero().squeeze(1)
        return embeds_TD.index_put((slots,), feats_ND)

    def _encode_share(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Context parallelism: this rank encodes its block of the images (``split_images``: at most its share of
        the patches plus one image; a rank without one runs the dummy image, so every rank's tower runs) and the
        features of all images are gathered in image order (``SequenceSplit.gather_rows``), gradients flowing back to
        their rank. Reads the grids on the host once (the split needs the sizes)."""
        split, visual = self.context_parallel, self.model.visual
        patches = image_grid_thw.prod(-1).tolist()
        merge = self.config.vision_config.spatial_merge_size**2
        blocks = split_images(patches, split.size)
        start, end = blocks[split.rank]
        first = sum(patches[:start])
        if start == end:
            grid, pixels = self._dummy_image(pixel_values.device)
            local = visual(pixels.to(pixel_values.dtype), grid_thw=grid).pooler_output[:0]
        else:
            rows = pixel_values[first : first + sum(patches[start:end])]
            local = visual(rows, grid_thw=image_grid_thw[start:end]).pooler_output
        return split.gather_rows(local, [sum(patches[a:b]) // merge for a, b in blocks])

    def _dummy_image(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest image the tower accepts (one merged token of zero pixels), for micro-batches without one."""
        vcfg = self.config.vision_config
        m = vcfg.spatial_merge_size
        row = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2
        return torch.tensor([[1, m, m]], dtype=torch.long, device=device), torch.zeros(m * m, row, device=device)

    @staticmethod
    def _count_inputs(mm_T: torch.Tensor | None, image_grid_thw: torch.Tensor) -> tuple[int, int, int]:
        """(vision slots, unsupported token types, patch rows the grids need), read from the device in one copy."""
        patches = image_grid_thw.prod(-1).sum()
        if mm_T is None:
            return 0, 0, int(patches)
        bad = (mm_T < TEXT_TOKEN_TYPE) | (mm_T > max(VISION_TOKEN_TYPES))
        counts = torch.stack([(mm_T != TEXT_TOKEN_TYPE).sum(), bad.sum(), patches.to(mm_T.device)])
        n_slots, n_bad, n_patches = counts.tolist()
        return n_slots, n_bad, n_patches

    # ------------------------------------------------------------------------------------------ loading

    def init_buffers(self, device: torch.device) -> None:
        """Recomputes the vision tower's non-persistent rotary buffers after a meta-device build (``to_empty``
        leaves them uninitialized, and no checkpoint holds them)."""
        for module in self.model.visual.modules():
            if hasattr(module, "compute_axial_rope_parameters") and hasattr(module, "inv_freq"):
                inv_freq, _ = module.compute_axial_rope_parameters(module.config)
                module.inv_freq = inv_freq.to(device)
                module.original_inv_freq = inv_freq.clone().to(device)
        leftovers = [n for n, t in [*self.named_parameters(), *self.named_buffers()] if t.is_meta]
        assert not leftovers, f"tensors left on the meta device after materializing: {leftovers}"


def _check_shapes(input_ids, position_ids, mm_token_type_ids, target_ids, loss_mask, router_mask) -> None:
    """``Qwen3_5VLM.forward``'s per-token inputs all have ``input_ids``' ``[B, L]`` shape (positions ``[3, B, L]``)."""
    B, L = input_ids.shape
    if position_ids is None:
        raise ValueError(
            "position_ids is required: MRoPE positions are built on the CPU by the data pipeline "
            "(PackedBatch.position_ids, or vlm_sft.data.mrope.sample_position_ids for one sample), never here"
        )
    if tuple(position_ids.shape) != (3, B, L):
        raise ValueError(f"position_ids must be [3, B, L] = [3, {B}, {L}], got {tuple(position_ids.shape)}")
    for name, value in (
        ("mm_token_type_ids", mm_token_type_ids), ("target_ids", target_ids), ("loss_mask", loss_mask),
        ("router_mask", router_mask),
    ):  # fmt: skip
        if value is not None and value.shape != input_ids.shape:
            raise ValueError(f"{name} shape {tuple(value.shape)} != input_ids shape {tuple(input_ids.shape)}")


def build_model(
    config: Qwen3_5Config | Qwen3_5MoeConfig,
    *,
    attn_impl: str = "auto",
    linear_attn_impl: str = "auto",
    loss_impl: str = "auto",
    experts_impl: str = "auto",
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    freeze_vision: bool = True,
    activation_checkpointing: bool = False,
) -> Qwen3_5VLM:
    """A randomly initialized ``Qwen3_5VLM`` (init as transformers' ``_init_weights``) on ``device``.

    Backends are resolved for ``device`` (None: CPU); a backend named explicitly but unavailable raises here.
    """
    device = torch.device(device if device is not None else "cpu")
    backends = resolve_backends(
        device, attn_impl=attn_impl, linear_attn_impl=linear_attn_impl, loss_impl=loss_impl, experts_impl=experts_impl
    )
    model = Qwen3_5VLM(config, backends, freeze_vision=freeze_vision, activation_checkpointing=activation_checkpointing)
    std = config.text_config.initializer_range
    model.model.language_model.apply(lambda m: init_text_weights(m, std))
    if is_moe_text_config(config.text_config):
        model.model.language_model.apply(lambda m: init_moe_weights(m, std))
    with torch.no_grad():
        if not model.tied_embeddings:
            model.lm_head.weight.normal_(0.0, std)
    logger.info("built Qwen3_5VLM (random init, %s on %s; backends %s)", dtype, device, backends)
    return model.to(device=device, dtype=dtype)
