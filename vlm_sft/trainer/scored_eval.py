"""Benchmark scores of generated replies: which held-out rows a scored source asks, the prompt each is asked with, the
score of each reply, and a source's score with its interval. One implementation behind the trainer's eval
(``eval_score/<name>``) and ``python -m vlm_sft.evaluate``, so both give the same number for the same replies.

- **Prompts.** The first ``max_scored`` rows of the source, in its order, each cut before its last assistant turn and
  rendered as a server's generation prompt (``renderer.render_prompt``) in the source's thinking mode. A row that
  cannot be asked (a missing image, no assistant turn) is left out and counted by reason.
- **References.** A ``qa`` row's reference answers (all of them; a multiple-choice row's letter and its options),
  else the last assistant turn's text.
- **Scores.** ``benchmark_metrics.score_reply`` on the reply as a server returns its content (special tokens left
  out), the think block cut where the source thinks; the source's score is the mean, with a seeded bootstrap 95%
  interval and the count of replies that could not be read as an answer.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from renderers import RenderedSample, RenderError
from vlm_sft.parallel.collectives import all_reduce, gather_objects
from vlm_sft.parallel.env import DistEnv
from vlm_sft.trainer.benchmark_metrics import bootstrap_interval, score_reply
from vlm_sft.trainer.generation import generate, image_names, split_last_reply, stop_token_ids

if TYPE_CHECKING:
    from vlm_sft.config import RunConfig, SourceConfig
    from vlm_sft.data.build import DataSources

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoredSource:
    """A held-out source that is scored, with its settings resolved."""

    name: str
    """Its name (``eval_score/<name>``)."""
    source: Any
    """Anything indexable by row that yields ``Conversation``s (a ``ConversationSource``)."""
    metric: str
    """One of ``benchmark_metrics.METRICS``."""
    thinking: bool
    """The thinking mode its prompts are rendered in and its replies are read in."""
    max_new_tokens: int
    """Longest reply."""
    max_scored: int | None = None
    """Rows asked (the first ones); None: all."""


def scored_source(cfg: RunConfig, table: SourceConfig, source: Any) -> ScoredSource:
    """``table``'s scoring settings with the run's defaults filled in (thinking mode, reply length)."""
    return ScoredSource(
        name=table.label,
        source=source,
        metric=table.metric,
        thinking=cfg.data.enable_thinking if table.thinking is None else table.thinking,
        max_new_tokens=table.max_new_tokens or cfg.train.eval_generate_max_tokens,
        max_scored=table.max_scored,
    )


@dataclass(frozen=True)
class ScoredPrompt:
    """One held-out row asked as a generation prompt, with what its reply is scored against."""

    source: str
    index: int
    """Row of its source."""
    text: str
    """The prompt text (image slots unexpanded)."""
    images: tuple[str, ...]
    references: tuple[str, ...]
    options: tuple[str, ...]
    metric: str
    thinking: bool
    max_new_tokens: int
    sample: RenderedSample
    """The prompt's tokens and images (loss mask all False)."""
    messages: list[dict]
    """The conversation before the reply (what a server is sent), for another backend to prompt with."""
    tools: list[dict] | None = None


def scored_prompts(scored: ScoredSource, renderer: Any) -> tuple[list[ScoredPrompt], Counter]:
    """The prompts of ``scored``'s first ``max_scored`` rows, and the rows left out by reason."""
    rows = range(len(scored.source) if scored.max_scored is None else min(scored.max_scored, len(scored.source)))
    prompts, skipped = [], Counter()
    for index in rows:
        try:
            conversation = scored.source[index]
            split = split_last_reply(conversation.messages)
            if split is None:
                skipped["no_assistant_turn"] += 1
                continue
            messages, last_reply = split
            sample = renderer.render_prompt(
                messages, tools=conversation.tools, sample_index=index, thinking=scored.thinking
            )
        except RenderError as e:
            skipped[e.reason] += 1
            continue
        prompts.append(
            ScoredPrompt(
                source=scored.name,
                index=index,
                text=sample.metadata["text"],
                images=image_names(messages),
                references=conversation.references or (last_reply,),
                options=conversation.options,
                metric=scored.metric,
                thinking=scored.thinking,
                max_new_tokens=scored.max_new_tokens,
                sample=sample,
                messages=messages,
                tools=conversation.tools,
            )
        )
    return prompts, skipped


def scored_eval_prompts(cfg: RunConfig, sources: DataSources, renderer: Any) -> dict[str, list[ScoredPrompt]]:
    """The prompts every eval asks of each scored held-out source (the same on every rank); rows left out are
    counted in one warning per source."""
    out = {}
    for table, source in sources.scored:
        prompts, skipped = scored_prompts(scored_source(cfg, table, source), renderer)
        if skipped:
            logger.warning("scored source %r: %d rows left out: %s", table.label, sum(skipped.values()), dict(skipped))
        out[table.label] = prompts
    return out


def prediction_text(tokenizer: Any, tokens: Sequence[int], *, thinking: bool) -> str:
    """A reply as a server returns its content (special tokens left out, whitespace stripped); in thinking mode the
    prompt opened the think block, so the reply is read with its ``<think>`` put back (a reply that never closes it
    was cut off inside it)."""
    text = tokenizer.decode(list(tokens), skip_special_tokens=True).strip()
    return f"<think>\n{text}" if thinking and "<think>" not in text else text


def score_prediction(prompt: ScoredPrompt, prediction: str) -> dict:
    """The predictions.jsonl / samples.jsonl row of one reply: the prompt, references and the reply's score."""
    score = score_reply(prompt.metric, prediction, prompt.references, options=prompt.options, thinking=prompt.thinking)
    return {
        "source": prompt.source,
        "index": prompt.index,
        "metric": prompt.metric,
        "prompt": prompt.text,
        "images": list(prompt.images),
        "references": list(prompt.references),
        "prediction": prediction,
        "answer": score.answer,
        "score": score.value,
        "parsed": score.parsed,
    }


def summarize(rows: Sequence[dict], *, seed: int = 0) -> dict[str, dict]:
    """Per source: ``score`` (the mean), ``count``, ``unparsed`` and the bootstrap ``interval95`` of the mean."""
    out = {}
    for name in sorted({r["source"] for r in rows}):
        values = [r["score"] for r in rows if r["source"] == name]
        low, high = bootstrap_interval(values, seed=seed)
        out[name] = {
            "metric": next(r["metric"] for r in rows if r["source"] == name),
            "score": sum(values) / len(values),
            "count": len(values),
            "unparsed": sum(not r["parsed"] for r in rows if r["source"] == name),
            "interval95": [None if math.isnan(low) else low, None if math.isnan(high) else high],
        }
    return out


def evaluate_scores(
    model: nn.Module,
    prompts: dict[str, list[ScoredPrompt]],
    env: DistEnv,
    tokenizer: Any,
    *,
    token_budget: int,
) -> tuple[dict[str, float], list[dict]]:
    """Greedy replies to every scored source's prompts (the same lists on every rank, dealt round-robin), scored:
    (``eval_score/<name>`` and ``eval_unparsed/<name>`` on every rank, the rows in source then row order on rank 0
    and empty elsewhere). Every rank makes the same calls (``generation.generate`` keeps them in step)."""
    stop_ids = stop_token_ids(tokenizer)
    metrics: dict[str, float] = {}
    rows: list[dict] = []
    for name, asked in prompts.items():
        if not asked:
            continue
        mine = asked[env.rank :: env.world_size]
        tokens = generate(
            model, [p.sample for p in mine], env, max_new_tokens=asked[0].max_new_tokens, stop_ids=stop_ids,
            token_budget=token_budget,
        )  # fmt: skip
        local = [
            score_prediction(p, prediction_text(tokenizer, t, thinking=p.thinking))
            for p, t in zip(mine, tokens, strict=True)
        ]
        tally = [sum(r["score"] for r in local), len(local), sum(not r["parsed"] for r in local)]
        total, count, unparsed = all_reduce(torch.tensor(tally, dtype=torch.float64), env, "sum").tolist()
        metrics[f"eval_score/{name}"] = total / count
        metrics[f"eval_unparsed/{name}"] = int(unparsed)
        gathered = gather_objects(local, env)
        if env.is_main:
            rows += sorted((r for part in gathered for r in part), key=lambda r: r["index"])
    return metrics, rows
