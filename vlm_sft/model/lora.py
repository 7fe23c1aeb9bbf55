"""LoRA adapters on the text model of ``Qwen3_5VLM``, through peft (a well-kept library, not hand-written adapters).

peft's ``inject_adapter_in_model`` replaces each targeted ``nn.Linear`` in place by a LoRA layer (the base weight
under ``base_layer``, the adapter under ``lora_A`` / ``lora_B``), so every module path stays what it was: FSDP2
still finds the decoder layers, and the checkpoint names stay transformers' with the adapter's keys beside them.

The targets are passed as full module names under ``model.language_model``: peft matches a short name by suffix
anywhere in the model, and the vision tower has its own ``qkv`` / ``proj`` / ``linear_fc*``, so short names could
adapt the tower by accident. After injection only the adapters require gradients: the base weights are frozen (and
stay bitwise unchanged), the vision tower was frozen already (a LoRA run never trains it).

``modules_to_save`` (``embed_tokens``, ``lm_head``) are trained in place rather than through peft's
``ModulesToSaveWrapper``: the wrapper keeps a second, frozen copy of the module (for ``lm_head`` of a 248k
vocabulary at 4096 wide, another 1 B parameters) to switch adapters, which a training run never does, and moves the
weight to ``X.modules_to_save.default.weight``. In place, the math is the same, module paths stay transformers', and
the adapter folder still holds the module under the key ``PeftModel`` loads (``lora_export``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

ADAPTER_NAME = "default"
"""The adapter peft injects (``inject_adapter_in_model``'s default name)."""
TEXT_MODEL_PREFIX = "model.language_model."
"""Where the text model's modules live in ``Qwen3_5VLM`` (and in transformers' ``Qwen3_5ForConditionalGeneration``)."""


def _text_linears(model: nn.Module) -> list[str]:
    """Full names of the text model's ``nn.Linear`` modules."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(TEXT_MODEL_PREFIX)]


def lora_target_names(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """Full names of the text model's ``nn.Linear`` modules whose last name part is in ``targets``."""
    wanted = set(targets)
    return [name for name in _text_linears(model) if name.rsplit(".", 1)[-1] in wanted]


def is_saved_module(name: str, modules_to_save: Sequence[str]) -> bool:
    """Whether the module called ``name`` is one ``modules_to_save`` trains: its last name part is listed and it sits
    on the text side (``lm_head`` or under the text model), never in the vision tower."""
    return name.rsplit(".", 1)[-1] in modules_to_save and (name == "lm_head" or name.startswith(TEXT_MODEL_PREFIX))


def save_module_names(model: nn.Module, modules_to_save: Sequence[str]) -> list[str]:
    """Full names of the modules ``modules_to_save`` trains; tied embeddings are refused (one weight, two names:
    peft would need both wrapped and tied, and training one silently trains the other)."""
    names = [n for n, _ in model.named_modules() if is_saved_module(n, modules_to_save)]
    if names and getattr(model, "tied_embeddings", False):
        raise ValueError(
            f"model.lora.modules_to_save {list(modules_to_save)}: this checkpoint ties lm_head to embed_tokens "
            "(tie_word_embeddings), so training either trains both; leave modules_to_save empty, or fine-tune fully"
        )
    return names


def attach_lora(
    model: nn.Module,
    *,
    r: int,
    alpha: float,
    dropout: float,
    targets: Sequence[str],
    modules_to_save: Sequence[str] = (),
) -> list[str]:
    """Inject LoRA adapters (peft, adapter ``default``) into the text model's ``targets``, unfreeze
    ``modules_to_save``; freeze everything else.

    Returns the full names of the adapted modules. Raises when a target matches no module of this model.
    """
    from peft import LoraConfig, inject_adapter_in_model

    names = lora_target_names(model, targets)
    found = {n.rsplit(".", 1)[-1] for n in names}
    missing = [t for t in targets if t not in found]
    if missing:
        available = sorted({n.rsplit(".", 1)[-1] for n in _text_linears(model)})
        raise ValueError(f"LoRA targets {missing} match no module of this model's text model; available: {available}")
    saved = save_module_names(model, modules_to_save)
    inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=names), model)
    for name, p in model.named_parameters():  # the adapters train; the base and the vision tower stay frozen
        module = name.rsplit(".", 1)[0]
        p.requires_grad_(".lora_A." in name or ".lora_B." in name or module in saved)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info(
        "LoRA r=%d alpha=%g on %d modules%s: %d trainable of %d parameters (%.2f%%)",
        r, alpha, len(names), f" (+ {', '.join(saved)} trained fully)" if saved else "", trainable, total,
        100 * trainable / max(total, 1),
    )  # fmt: skip
    return names


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Keep the frozen parameters (the base and the vision tower) in ``dtype`` and every trainable one in float32.

    For bf16 LoRA runs: the frozen base is most of the memory and FSDP2's mixed precision computes in bf16 anyway, so
    storing it in bf16 gives the same numbers at half the bytes. FSDP2 accepts frozen parameters of another dtype
    beside the trainable ones in one unit, but trainable parameters must share one dtype: float32. Buffers (rotary
    frequencies) are left as they are.
    """
    with torch.no_grad():
        for p in model.parameters():
            want = torch.float32 if p.requires_grad else dtype
            if p.is_floating_point() and p.dtype != want:
                p.data = p.data.to(want)


RowRule = Callable[[torch.Tensor], tuple[torch.Tensor, int, int]]
"""``t -> (the part of t this rank holds, its first row, its end row)`` on dim 0."""


def whole_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The row rule of a model that is not sharded: every tensor held whole (a sharded one is refused)."""
    if hasattr(t, "to_local"):
        raise ValueError("a sharded (DTensor) adapter: pass rows=vlm_sft.parallel.fsdp.local_rows")
    return t, 0, (t.shape[0] if t.dim() else 0)


def init_adapters(model: nn.Module, seed: int, *, rows: RowRule | None = None) -> None:
    """peft's default LoRA init (A Kaiming-uniform, B zero) redone from ``seed`` on the adapters as they are now.

    peft initializes each adapter in its base layer's dtype, so on a base loaded in bf16 A would be drawn in bf16 and
    only then raised to fp32 (``store_frozen_in``): a bf16 and an fp32 run with one seed would start differently.
    Here each A is drawn whole in fp32 on the CPU, module by module from one generator, and each rank keeps the rows
    its shard holds: the same adapters on any number of ranks, whatever the base's dtype, sharded (FSDP2 DTensors,
    also straight after ``to_empty``) or not. ``rows``: the sharding's row rule (``parallel.fsdp.local_rows``) for a
    sharded model; without it every adapter must be a plain tensor held whole.
    """
    from peft.tuners.lora import LoraLayer

    local_rows = rows or whole_rows
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, LoraLayer) or ADAPTER_NAME not in module.lora_A:
                continue
            a, b = module.lora_A[ADAPTER_NAME].weight, module.lora_B[ADAPTER_NAME].weight
            full = torch.empty(a.shape, dtype=torch.float32)
            bound = 1.0 / math.sqrt(full.shape[1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3 / fan_in)
            full.uniform_(-bound, bound, generator=generator)
            local, start, stop = local_rows(a)
            local.copy_(full[start:stop])
            local_rows(b)[0].zero_()


def base_fingerprint(model: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> str:
    """A digest of the frozen parameters (names, dtypes, shapes, sums and absolute sums, to 9 significant digits).

    A LoRA checkpoint holds only what trains and a resume rebuilds the base from ``model.name_or_path``: a base that
    changed in between (another revision, a rewritten local directory, another dtype) would resume silently inexact.
    The trainer stores this digest in each checkpoint and refuses a resume onto a base with another one. On a sharded
    model each rank sums its shards and ``reduce`` (an all-reduce sum over the ranks, on a CPU float64 tensor) adds
    them up; the rounding to 9 digits makes the digest the same for any number of ranks.
    """
    import hashlib

    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    sums = torch.zeros(len(frozen), 2, dtype=torch.float64)
    with torch.no_grad():
        for i, (_, p) in enumerate(frozen):
            local = p.to_local() if hasattr(p, "to_local") else p
            for chunk in local.detach().reshape(-1).split(1 << 24):  # float64 in 128 MB pieces, never a whole copy
                c = chunk.double()
                sums[i, 0] += c.sum().cpu()
                sums[i, 1] += c.abs().sum().cpu()
    if reduce is not None:
        sums = reduce(sums)
    digest = hashlib.sha256()
    for (name, p), (total, absolute) in zip(frozen, sums.tolist(), strict=True):
        digest.update(f"{name} {p.dtype} {tuple(p.shape)} {total:.9g} {absolute:.9g};".encode())
    return digest.hexdigest()[:16]
