"""Generated answers in eval: greedy replies to held-out prompts rendered exactly as a server renders them.

Teacher-forced accuracy (``trainer.evaluate``) feeds the reference prefix at every position; a served model feeds
its own tokens, after the prompt the checkpoint's own chat template builds. This module asks the second question.

- **Prompts.** A fixed, seeded choice of ``train.eval_generate`` held-out rows (the same every eval, so the curves
  compare like with like), each cut before its last assistant turn and rendered by ``renderer.render_prompt``: the
  run's template with ``add_generation_prompt`` in the run's thinking mode, which is the saved template's default
  (``renderers.served``), i.e. what ``apply_chat_template(messages[:-1], add_generation_prompt=True)`` gives a server.
  The reference is that last turn's content.
- **Decoding.** Greedy, at most ``max_new_tokens`` tokens, until the tokenizer's end-of-turn or end-of-text token, on
  the model's decode cache (``vlm_sft.model.decode``): one prefill forward of a packed row of prompts, then one
  forward of one token per prompt per step; never a full forward per token.
- **In step.** Every rank runs the same number of forwards with the same collectives (FSDP all-gathers each layer in
  each): the prompts are dealt to ranks round-robin, grouped by ``token_budget`` per prefill, a rank short of groups
  prefills a one-token filler, and each decode step ends with one all-reduce of "anyone still generating" on a host
  tensor.
- **Scored** by exact match of the reply (its reasoning, if any, left out) with the reference, whitespace stripped:
  ``eval_gen_acc_<task>`` and ``eval_gen_acc_all`` beside the teacher-forced ``eval_acc_*``.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from renderers import RenderedSample, RenderError
from vlm_sft.data.mrope import batch_position_ids
from vlm_sft.model.decode import DecodeCache, decode_position_ids, next_positions
from vlm_sft.parallel.collectives import all_reduce, gather_objects
from vlm_sft.parallel.env import DistEnv

if TYPE_CHECKING:
    from vlm_sft.config import RunConfig
    from vlm_sft.data.build import DataSources

logger = logging.getLogger(__name__)

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
"""Tokens that end a reply (the turn end, as a server's stop tokens; and the end of text)."""


@dataclass(frozen=True)
class GenerationPrompt:
    """One held-out conversation, cut before its last reply and rendered as a server's generation prompt."""

    index: int
    """Row of the held-out source."""
    task: str
    """The row's ``task`` (``all`` when the data has none)."""
    text: str
    """The prompt text, as the served template writes it (image slots unexpanded)."""
    images: tuple[str, ...]
    """The prompt's image files by name (``<embedded>`` for images given as bytes)."""
    reference: str
    """The content of the last assistant turn: the answer a correct reply gives."""
    sample: RenderedSample
    """The prompt's tokens, modality types and images (``loss_mask`` all False)."""


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or () if isinstance(b, dict) and b.get("type", "text") == "text")


def image_names(messages: Sequence[dict]) -> tuple[str, ...]:
    names = []
    for m in messages:
        for b in m.get("content") if isinstance(m.get("content"), list) else ():
            if isinstance(b, dict) and b.get("type") in ("image", "image_url"):
                source = b.get("image", b.get("image_url"))
                source = source.get("url") if isinstance(source, dict) else source
                names.append(Path(source).name if isinstance(source, str) and len(source) < 4096 else "<embedded>")
    return tuple(names)


def split_last_reply(messages: Sequence[dict]) -> tuple[list[dict], str] | None:
    """(the conversation before its last assistant turn, that turn's text content), or None without one. Messages
    after the last reply (a trailing user turn) are dropped with it: the prompt is what a server got."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        return None
    return list(messages[:last]), _text_of(messages[last].get("content")).strip()


def select_prompts(source: Any, tasks: dict[int, str], count: int, seed: int, renderer: Any) -> list[GenerationPrompt]:
    """``count`` held-out rows chosen with ``seed`` (all of them when fewer), rendered as generation prompts.

    A row that cannot be rendered (a missing image, no assistant turn) is left out and counted in one warning with
    its reasons: nothing is skipped silently."""
    rows = sorted(random.Random(seed).sample(range(len(source)), min(count, len(source))))
    prompts, skipped = [], Counter()
    for index in rows:
        try:
            conversation = source[index]  # a malformed row raises here; the data pipeline reports it too
            split = split_last_reply(conversation.messages)
            if split is None:
                skipped["no_assistant_turn"] += 1
                continue
            messages, reference = split
            sample = renderer.render_prompt(messages, tools=conversation.tools, sample_index=index)
        except RenderError as e:
            skipped[e.reason] += 1
            continue
        prompts.append(
            GenerationPrompt(
                index=index,
                task=tasks.get(index, "all"),
                text=sample.metadata["text"],
                images=image_names(messages),
                reference=reference,
                sample=sample,
            )
        )
    if skipped:
        logger.warning(
            "eval generation: %d of %d chosen prompts left out: %s", sum(skipped.values()), len(rows), dict(skipped)
        )
    return prompts


def _prefill_inputs(
    samples: Sequence[RenderedSample], merge: int, device: torch.device
) -> tuple[dict[str, Any], list[int]]:
    """One packed row of prompts (each its own segment) as ``Qwen3_5VLM.forward`` takes it, and each prompt's first
    decode position (``decode.next_positions``)."""
    images = [s.multi_modal_data for s in samples if s.multi_modal_data is not None]
    lengths = [len(s) for s in samples]
    types = torch.cat([s.mm_token_type_ids for s in samples]).view(1, -1)
    grids = torch.cat([m.image_grid_thw for m in images]) if images else None
    position_ids = batch_position_ids(types, grids, lengths, spatial_merge_size=merge)
    inputs = {
        "input_ids": torch.cat([s.token_ids for s in samples]).view(1, -1).to(device),
        "position_ids": position_ids.to(device),
        "seq_lens": torch.tensor(lengths),
        "mm_token_type_ids": types.to(device),
        "pixel_values": torch.cat([m.pixel_values for m in images]).to(device) if images else None,
        "image_grid_thw": grids.to(device) if images else None,
    }
    return inputs, next_positions(position_ids, lengths)


def _filler() -> RenderedSample:
    """A one-token text prompt: a rank without prompts of its own prefills and decodes this, in step with its peers."""
    zero = torch.zeros(1, dtype=torch.long)
    return RenderedSample(token_ids=zero, loss_mask=torch.zeros(1, dtype=torch.bool), mm_token_type_ids=zero)


def _groups(samples: Sequence[RenderedSample], token_budget: int) -> list[list[int]]:
    """Consecutive prompts whose tokens fit ``token_budget`` per prefill (a longer prompt alone)."""
    groups: list[list[int]] = []
    used = token_budget
    for i, s in enumerate(samples):
        if used + len(s) > token_budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += len(s)
    return groups


@torch.no_grad()
def _decode_group(
    model: nn.Module,
    samples: Sequence[RenderedSample],
    env: DistEnv,
    *,
    max_new_tokens: int,
    stop_ids: torch.Tensor,
    active: bool = True,
) -> list[list[int]]:
    """Greedy replies to one group of prompts: a prefill, then up to ``max_new_tokens - 1`` decode steps, stopping
    when no rank has a reply still running (one all-reduce per step). ``active`` False: a filler group, which keeps
    its rank in step and never holds the others up."""
    merge = model.config.vision_config.spatial_merge_size
    inputs, positions = _prefill_inputs(samples, merge, env.device)
    cache = DecodeCache(reserve_tokens=max_new_tokens)
    logits = model(**inputs, cache=cache)
    replies: list[list[int]] = [[] for _ in samples]
    running = torch.full((len(samples),), active, dtype=torch.bool)
    for step in range(max_new_tokens):
        tokens = logits.argmax(-1).cpu()
        for i in running.nonzero().flatten().tolist():
            replies[i].append(int(tokens[i]))
        running &= ~torch.isin(tokens, stop_ids)
        anyone = int(all_reduce(torch.tensor([int(running.any())]), env, "max"))
        if not anyone or step == max_new_tokens - 1:
            break
        step_positions = decode_position_ids(positions, step, env.device)
        logits = model(tokens.view(-1, 1).to(env.device), position_ids=step_positions, cache=cache)
    return replies


def generate(
    model: nn.Module,
    samples: Sequence[RenderedSample],
    env: DistEnv,
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    token_budget: int,
) -> list[list[int]]:
    """Greedy reply tokens (stop token included when reached) for this rank's ``samples``; every rank must call it
    with its own share (possibly none). Eval mode for the duration (no dropout)."""
    groups = _groups(samples, token_budget)
    n_groups = int(all_reduce(torch.tensor([len(groups)]), env, "max"))
    stops = torch.tensor(list(stop_ids), dtype=torch.long)
    replies: list[list[int]] = [[] for _ in samples]
    was_training = model.training
    model.eval()
    try:
        for g in range(n_groups):
            members = groups[g] if g < len(groups) else []
            group = [samples[i] for i in members] or [_filler()]
            out = _decode_group(model, group, env, max_new_tokens=max_new_tokens, stop_ids=stops, active=bool(members))
            for i, tokens in zip(members, out, strict=False):
                replies[i] = tokens
    finally:
        model.train(was_training)
    return replies


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The ids of ``STOP_TOKENS`` this tokenizer has."""
    ids = tokenizer.convert_tokens_to_ids(list(STOP_TOKENS))
    return [i for i in ids if i is not None and i >= 0 and i != tokenizer.unk_token_id]


def reply_text(tokenizer: Any, tokens: Sequence[int]) -> str:
    """The reply as a server returns its content: decoded without special tokens, any reasoning (through the last
    ``</think>``) left out, whitespace stripped."""
    text = tokenizer.decode(list(tokens), skip_special_tokens=True)
    return text.rsplit("</think>", 1)[-1].strip()


def is_correct(reply: str, reference: str) -> bool:
    """Exact match of a reply (``reply_text``) with its reference, surrounding whitespace ignored."""
    return reply.strip() == reference.strip()


def generation_prompts(cfg: RunConfig, sources: DataSources, renderer: Any) -> list[GenerationPrompt]:
    """The held-out prompts every eval answers by generation (none without eval data or with eval_generate = 0)."""
    if sources.eval is None or not cfg.train.eval_generate:
        return []
    return select_prompts(sources.eval, sources.eval_tasks, cfg.train.eval_generate, cfg.train.seed, renderer)


def evaluate_generation(
    model: nn.Module,
    prompts: Sequence[GenerationPrompt],
    env: DistEnv,
    tokenizer: Any,
    *,
    step: int,
    max_new_tokens: int,
    token_budget: int,
    task_names: Sequence[str],
) -> tuple[dict[str, float], list[dict]]:
    """Replies to every rank's share of ``prompts`` (the same list on every rank), scored; (metrics, the samples
    rows in prompt order: on rank 0 only, empty elsewhere). ``task_names``: the held-out tasks, the same on every
    rank (they fix the layout of the reduced tallies)."""
    start = time.perf_counter()
    mine = list(prompts[env.rank :: env.world_size])
    stop_ids = stop_token_ids(tokenizer)
    tokens = generate(
        model, [p.sample for p in mine], env, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
        token_budget=token_budget,
    )  # fmt: skip
    rows = [
        {
            "step": step,
            "index": p.index,
            "task": p.task,
            "prompt": p.text,
            "images": list(p.images),
            "reference": p.reference,
            "reply": reply_text(tokenizer, t),
            "reply_tokens": len(t),
        }
        for p, t in zip(mine, tokens, strict=True)
    ]
    for row in rows:
        row["correct"] = is_correct(row["reply"], row["reference"])
    keys = sorted(set(task_names) | {"all"})
    tallies = torch.zeros(len(keys), 2, dtype=torch.float64)
    for row in rows:
        for key in {row["task"], "all"}:
            tallies[keys.index(key)] += torch.tensor([float(row["correct"]), 1.0])
    total = all_reduce(tallies.flatten(), env, "sum").view(-1, 2)
    metrics = {f"eval_gen_acc_{k}": float(c / n) for k, (c, n) in zip(keys, total.tolist(), strict=True) if n}
    metrics["eval_gen_samples"] = int(total[keys.index("all"), 1])
    metrics["eval_gen_s"] = time.perf_counter() - start
    gathered = gather_objects(rows, env)
    ordered = sorted((r for part in gathered for r in part), key=lambda r: r["index"]) if env.is_main else []
    return metrics, ordered
