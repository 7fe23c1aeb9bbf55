"""Display helpers for the notebooks: source rows, rendered samples, packed rows, data reports, checkpoint probes.

The notebooks in ``notebooks/`` stay a few calls per cell and import only the project and matplotlib; the drawing
code lives here, where it is linted and tested with the package. Plot helpers return a matplotlib ``Figure`` built
without pyplot (so a figure is shown once, as the cell's value, whatever the backend: ``setup_notebook`` registers
the png formatter, which also works under ``MPLBACKEND=Agg`` as in CI); text helpers return ``HTML``, which a
notebook shows rich. Nothing in the training path imports this module (the run's own picture is ``vlm_sft.plot``).
"""

from __future__ import annotations

import html
import io
import logging
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from PIL import Image

from renderers import TEXT_TOKEN_TYPE, RenderedSample, TextBlock, load_image, normalize_messages
from vlm_sft.data.batch import PackedBatch
from vlm_sft.data.collate import collate
from vlm_sft.data.mrope import sample_position_ids
from vlm_sft.data.pack import Pack
from vlm_sft.data.shift import shift_sample
from vlm_sft.trainer.scoring import score_batch

TRAINABLE_COLOUR = "#9be39b"
IMAGE_COLOUR = "#f5b041"
SPECIAL_COLOUR = "#d5d8dc"
PADDING_COLOUR = "#eeeeee"
AXIS_COLOURS = {"t": "#1f77b4", "h": "#d62728", "w": "#2ca02c"}


@dataclass(frozen=True)
class HTML:
    """An HTML fragment that a notebook displays rich; ``str()`` gives the plain-text version."""

    html: str
    """The markup (inline styles only, so it survives being saved in the notebook)."""
    text: str
    """Plain-text fallback, shown by consoles and by viewers that drop HTML."""

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return self.text


def figure_png(fig: Figure, dpi: int = 72) -> bytes:
    """The figure as png bytes (modest dpi keeps committed notebooks small)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def setup_notebook(dpi: int = 72) -> None:
    """Show returned ``Figure`` values as png at ``dpi``, and keep info logs and ``datasets`` bars out of the output.

    (tqdm reads ``TQDM_DISABLE`` only when it is imported, so the notebook runner sets that in the kernel's
    environment instead.)
    """
    import datasets

    datasets.disable_progress_bars()
    logging.getLogger().setLevel(logging.WARNING)
    for name in ("datasets", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        shell.display_formatter.formatters["image/png"].for_type(Figure, lambda fig: figure_png(fig, dpi))


# ------------------------------------------------------------------------------------------------ source rows


def _images_and_text(messages: Sequence[dict]) -> tuple[list[Image.Image], str, str]:
    """The images, the last user text and the last assistant text of a conversation (any accepted row shape)."""
    images, texts = [], {"user": "", "assistant": ""}
    for m in normalize_messages(messages):
        images += [load_image(b.source, b.key) for b in m.images]
        texts[m.role] = " ".join(b.text for b in m.blocks if isinstance(b, TextBlock))
    return images, texts["user"], texts["assistant"]


def side_by_side(images: Sequence[Image.Image], gap: int = 4) -> Image.Image:
    """The images in one picture, left to right on white."""
    height = max(im.height for im in images)
    out = Image.new("RGB", (sum(im.width for im in images) + gap * (len(images) - 1), height), "white")
    x = 0
    for im in images:
        out.paste(im, (x, 0))
        x += im.width + gap
    return out


def plot_rows(source: Any, indices: Sequence[int], *, ncols: int = 4) -> Figure:
    """A grid of source rows (``ConversationSource``): each row's images, titled with its question and answer."""
    nrows = -(-len(indices) // ncols)
    fig = Figure(figsize=(2.5 * ncols, 3.1 * nrows))
    for k, index in enumerate(indices):
        ax = fig.add_subplot(nrows, ncols, k + 1)
        images, question, answer = _images_and_text(source[index].messages)
        if images:
            ax.imshow(side_by_side(images), interpolation="nearest")
        else:
            ax.text(0.5, 0.5, "(text only)", ha="center", va="center", color="grey")
        ax.set_xticks([])
        ax.set_yticks([])
        title = textwrap.fill(f"row {index}: {question}", 30) + "\n" + textwrap.fill(f"-> {answer}", 30)
        ax.set_title(title, fontsize=8, loc="left")
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------- rendered samples


@dataclass(frozen=True)
class TokenPiece:
    """One displayed piece of a sample: a token, or a whole run of image slots."""

    text: str
    """What is shown (newlines as a return arrow; an image run as ``[image k: n slots]``)."""
    kind: str
    """``trainable``, ``image``, ``special`` or ``prompt``."""


def token_pieces(sample: RenderedSample, tokenizer: Any) -> list[TokenPiece]:
    """The sample's tokens, classified for display; each image's placeholder run becomes one piece."""
    special = set(getattr(tokenizer, "all_special_ids", [])) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    ids, mask, types = sample.token_ids.tolist(), sample.loss_mask.tolist(), sample.mm_token_type_ids.tolist()
    grids = [] if sample.multi_modal_data is None else sample.multi_modal_data.image_grid_thw.tolist()
    pieces: list[TokenPiece] = []
    i = image = 0
    while i < len(ids):
        j = i + 1
        if types[i] != TEXT_TOKEN_TYPE:
            while j < len(ids) and types[j] == types[i]:
                j += 1
            grid = "x".join(str(g) for g in grids[image]) if image < len(grids) else "?"
            what = "image" if types[i] == 1 else "video group"  # 2: one temporal group of a video
            pieces.append(TokenPiece(f"[{what} {image}: {j - i} slots, grid {grid}]", "image"))
            image += 1
        else:
            kind = "trainable" if mask[i] else ("special" if ids[i] in special else "prompt")
            pieces.append(TokenPiece(tokenizer.decode([ids[i]]).replace("\n", "\u21b5"), kind))
        i = j
    return pieces


_PIECE_COLOUR = {"trainable": TRAINABLE_COLOUR, "image": IMAGE_COLOUR, "special": SPECIAL_COLOUR, "prompt": "white"}
_PIECE_LABEL = {"trainable": "trainable", "image": "image slots", "special": "special token", "prompt": "prompt"}


def sample_html(sample: RenderedSample, tokenizer: Any) -> HTML:
    """The sample's text with trainable tokens highlighted green and image slot runs marked orange."""
    spans = []
    for p in token_pieces(sample, tokenizer):
        text = html.escape(p.text).replace("\u21b5", "\u21b5<br>")
        style = f"background:{_PIECE_COLOUR[p.kind]};border:1px solid #ccc;margin:1px"
        spans.append(f'<span style="{style}">{text}</span>')
    legend = " ".join(f'<span style="background:{_PIECE_COLOUR[k]}">{v}</span>' for k, v in _PIECE_LABEL.items())
    body = f'<div style="font-family:monospace;line-height:1.9">{"".join(spans)}</div><p>{legend}</p>'
    trained = tokenizer.decode(sample.token_ids[sample.loss_mask].tolist())
    return HTML(body, f"{len(sample)} tokens, {sample.num_trainable_tokens} trainable: {trained!r}")


def plot_tokens(sample: RenderedSample, tokenizer: Any, *, width: int = 110, max_pieces: int = 400) -> Figure:
    """The same view as ``sample_html`` drawn with matplotlib (what the repository page shows as a picture)."""
    pieces = token_pieces(sample, tokenizer)[:max_pieces]
    lines: list[list[tuple[int, TokenPiece]]] = [[]]
    x = 0
    for p in pieces:
        w = len(p.text) + 1
        if x + w > width and lines[-1]:
            lines.append([])
            x = 0
        lines[-1].append((x, p))
        x += w
        if p.text.endswith("\u21b5"):
            lines.append([])
            x = 0
    lines = [line for line in lines if line]
    # DejaVu Sans Mono advances 0.6 em: at 9 pt one character is 0.075 inch, so x counts characters.
    fig = Figure(figsize=(width * 0.075, 0.3 * len(lines) + 0.6))
    ax = fig.add_axes((0, 0.12, 1, 0.88))
    ax.set_xlim(0, width)
    ax.set_ylim(len(lines), 0)
    ax.axis("off")
    for y, line in enumerate(lines):
        for x, p in line:
            colour = _PIECE_COLOUR[p.kind]
            ax.add_patch(Rectangle((x, y + 0.1), len(p.text), 0.8, facecolor=colour, edgecolor="#bbbbbb", lw=0.5))
            ax.text(x, y + 0.5, p.text, family="monospace", fontsize=9, va="center")
    handles = [Patch(facecolor=_PIECE_COLOUR[k], edgecolor="#bbbbbb", label=v) for k, v in _PIECE_LABEL.items()]
    fig.legend(handles=handles, loc="lower left", ncols=4, fontsize=8, frameon=False)
    return fig


# ------------------------------------------------------------------------------------------------ packed rows


def row_segments(batch: PackedBatch, row: int) -> list[tuple[int, int, int | None]]:
    """``(start, end, dataset index or None for padding)`` of every segment of ``row`` (``PackedBatch.row_segments``)."""
    return batch.row_segments(row)


def _strip(ax, values: torch.Tensor, cmap, label: str, vmax: int) -> None:
    ax.imshow(values[None, :].numpy(), aspect="auto", cmap=cmap, vmin=0, vmax=vmax, interpolation="nearest")
    ax.set_yticks([0], [label])
    ax.tick_params(axis="x", labelbottom=False)


def plot_pack(batch: PackedBatch, row: int = 0) -> Figure:
    """One packed row: its segments (samples, padding), image runs, loss mask, and MRoPE position streams.

    The bottom panel zooms into the first sample with an image: text advances t, h and w together, an image's
    slots spread over its merged (h, w) grid at one t, and the text after it resumes at start + max(h, w).
    """
    _, length = batch.shape
    segments = row_segments(batch, row)
    seg_colour = torch.zeros(length, dtype=torch.long)
    for k, (s, e, idx) in enumerate(segments):
        seg_colour[s:e] = 0 if idx is None else 1 + k % 10
    palette = ListedColormap([PADDING_COLOUR, *[f"C{k}" for k in range(10)]])
    fig = Figure(figsize=(12, 8.5))
    grid = fig.add_gridspec(5, 1, height_ratios=[0.45, 0.3, 0.3, 2.2, 2.2], hspace=0.5)
    ax_seg = fig.add_subplot(grid[0])
    _strip(ax_seg, seg_colour, palette, "samples", 10)
    for s, e, idx in segments:
        if e - s >= 0.03 * length:
            ax_seg.text((s + e) / 2, 0, "pad" if idx is None else str(idx), ha="center", va="center", fontsize=7)
    ax_seg.set_title(
        f"row {row}: {len(batch.sample_indices[row])} samples (labels: dataset row), "
        f"{sum(e - s for s, e, i in segments if i is None)} padding tokens of {length}",
        fontsize=10,
        loc="left",
    )
    types = batch.mm_token_type_ids[row]
    mask = batch.loss_mask[row].long()
    is_image = (types != TEXT_TOKEN_TYPE).long()
    _strip(fig.add_subplot(grid[1], sharex=ax_seg), is_image, ListedColormap(["white", IMAGE_COLOUR]), "image", 1)
    _strip(fig.add_subplot(grid[2], sharex=ax_seg), mask, ListedColormap(["white", TRAINABLE_COLOUR]), "loss", 1)
    ax_pos = fig.add_subplot(grid[3], sharex=ax_seg)
    pos = batch.position_ids[:, row, :]
    for k, (name, style) in enumerate(zip("thw", ("-", "--", ":"), strict=True)):
        ax_pos.plot(pos[k].numpy(), style, color=AXIS_COLOURS[name], lw=1.6 - 0.4 * k, label=name)
    for s, _, _ in segments[1:]:
        ax_pos.axvline(s - 0.5, color="grey", lw=0.5)
    ax_pos.set_xlim(-0.5, length - 0.5)
    ax_pos.set_ylabel("MRoPE position")
    ax_pos.set_xlabel("token in row (grey lines: segment starts; positions restart at 0 in every segment)")
    ax_pos.legend(loc="upper right", fontsize=8, ncols=3)
    _plot_segment_positions(fig.add_subplot(grid[4]), batch, row, segments)
    return fig


def _plot_segment_positions(ax, batch: PackedBatch, row: int, segments, context: int = 6) -> None:
    """Zoom: t / h / w around the image runs of the first sample that has images, values written on the slots."""
    types = batch.mm_token_type_ids[row]
    has_image = [i is not None and bool((types[s:e] != TEXT_TOKEN_TYPE).any()) for s, e, i in segments]
    chosen = next((seg for seg, yes in zip(segments, has_image, strict=True) if yes), None)
    s, e, idx = chosen if chosen is not None else segments[0]
    image = (types[s:e] != TEXT_TOKEN_TYPE).nonzero().flatten().tolist()
    lo = max(0, image[0] - context) if image else 0
    hi = min(e - s, image[-1] + context + 1) if image else min(e - s, 4 * context)
    pos = batch.position_ids[:, row, s + lo : s + hi]
    x = torch.arange(lo, hi)
    for k, (name, marker) in enumerate(zip("thw", "osd", strict=True)):
        ax.plot(x + (k - 1) * 0.15, pos[k], marker=marker, ms=4, lw=0.8, color=AXIS_COLOURS[name], label=name)
    for t in image:
        ax.axvspan(t - 0.5, t + 0.5, color=IMAGE_COLOUR, alpha=0.35, lw=0)
        p = batch.position_ids[:, row, s + t].tolist()
        ax.text(t, max(p) + 0.4, f"{p[0]},{p[1]},{p[2]}", ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_xlim(lo - 0.5, hi - 0.5)
    ax.margins(y=0.25)
    ax.set_ylabel("position")
    ax.set_xlabel(
        f"token in sample {idx} (orange: image slots, labelled t,h,w: one t, the merged (h, w) grid; "
        "the text after an image resumes at start + max(h, w))"
    )
    ax.legend(loc="upper left", fontsize=8, ncols=3)


# ----------------------------------------------------------------------------------------------- data reports


def plot_packing_comparison(reports: dict[str, dict], *, title: str = "") -> Figure:
    """Packing efficiency, rows and padding per packing mode (``build_report`` / ``summarize_pass`` results)."""
    modes = list(reports)
    fig = Figure(figsize=(11, 3.2))
    efficiency = ("packing_efficiency", "packing efficiency (real / capacity)", "{:.3f}")
    panels = (efficiency, ("rows", "rows of tokens", "{:d}"), ("padding_tokens", "padding tokens", "{:d}"))
    for k, (key, label, fmt) in enumerate(panels):
        ax = fig.add_subplot(1, 3, k + 1)
        values = [reports[m][key] for m in modes]
        bars = ax.bar(modes, values, color=[f"C{i}" for i in range(len(modes))])
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=8)
        ax.set_title(label, fontsize=10)
        if key == "packing_efficiency":
            ax.set_ylim(0, 1.08)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def plot_pass_statistics(packs: Sequence[Pack], *, seq_len: int | None = None) -> Figure:
    """Sample lengths, fill per pack and image patches per pack of one pass (``list(pipeline)``)."""
    lengths = [len(s) for p in packs for s in p.samples]
    fill = [p.num_real_tokens / p.capacity for p in packs]
    patches = [p.num_patches for p in packs]
    fig = Figure(figsize=(12, 3.2))
    ax = fig.add_subplot(1, 3, 1)
    ax.hist(lengths, bins=30, color="C0")
    if seq_len is not None and seq_len <= 1.5 * max(lengths, default=0):
        ax.axvline(seq_len, color="red", lw=1, label=f"seq_len {seq_len}")
        ax.legend(fontsize=8)
    ax.set_title(f"sample length (inputs), {len(lengths)} samples", fontsize=10)
    ax = fig.add_subplot(1, 3, 2)
    ax.bar(range(len(fill)), fill, color="C2", width=1.0)
    ax.set_ylim(0, 1.05)
    ax.set_title(f"fill of each of {len(packs)} packs (real / row tokens)", fontsize=10)
    ax = fig.add_subplot(1, 3, 3)
    ax.hist(patches, bins=20, color=IMAGE_COLOUR)
    ax.set_title("image patches per pack", fontsize=10)
    fig.tight_layout()
    return fig


def explain_skips(skipped: dict[str, dict]) -> HTML:
    """A table of skip reasons with each example row and the error's detail, as the pipeline recorded them."""
    rows = [
        (reason, info["count"], e["row"], e["detail"] or "(no detail)")
        for reason, info in skipped.items()
        for e in info["examples"]
    ]
    cells = "".join(
        f"<tr><td>{html.escape(r)}</td><td>{n}</td><td>{i}</td><td>{html.escape(m)}</td></tr>" for r, n, i, m in rows
    )
    table = f"<table><tr><th>reason</th><th>count</th><th>row</th><th>error</th></tr>{cells}</table>"
    text = "\n".join(f"{r:<28} x{n}  row {i}: {m}" for r, n, i, m in rows) or "no skipped samples"
    return HTML(table, text)


# ------------------------------------------------------------------------------------------- checkpoint probes


@dataclass(frozen=True)
class ReplyScores:
    """Teacher-forced predictions of one sample at its trainable positions (per-token lists, for plotting).

    Named apart from ``vlm_sft.model.loss.TokenScores``, the model's ``[B, L]`` tensors these are read from.
    """

    targets: list[str]
    """The reference tokens (decoded one by one)."""
    predicted: list[str]
    """The model's argmax at each of those positions, given the reference prefix."""
    losses: list[float]
    """Cross-entropy of each reference token (nats)."""
    correct: list[bool]
    """Whether the argmax token is the reference token."""


def _single_batch(sample: RenderedSample, pad_id: int, merge: int) -> PackedBatch:
    shifted = shift_sample(sample)
    return collate([Pack(rows=((shifted,),), row_len=len(shifted))], pad_id=pad_id, spatial_merge_size=merge)


def teacher_forced(model: Any, sample: RenderedSample, tokenizer: Any) -> ReplyScores:
    """Per-token loss and argmax of ``model`` on the trainable tokens of ``sample``.

    Scored by the trainer's eval code (``score_batch``: chunked, no full logits), so a probe and the eval accuracy
    can never disagree on what the model predicted.
    """
    batch = _single_batch(sample, int(tokenizer.pad_token_id), model.config.vision_config.spatial_merge_size)
    scored = score_batch(model, batch, next(model.parameters()).device)
    mask = batch.loss_mask[0]
    targets, predicted = batch.target_ids[0][mask], scored.argmax[0][mask]
    return ReplyScores(
        targets=[tokenizer.decode([t]) for t in targets.tolist()],
        predicted=[tokenizer.decode([t]) for t in predicted.tolist()],
        losses=scored.nll[0][mask].tolist(),
        correct=(predicted == targets).tolist(),
    )


@torch.no_grad()
def greedy_answer(model: Any, sample: RenderedSample, tokenizer: Any, *, max_new_tokens: int = 16) -> str:
    """Greedy decoding after the prompt part of ``sample`` (everything before its first trainable token).

    The model has no ``generate()`` and no cache: each step re-runs the forward over the whole sequence, which is
    fine for a few tokens of a tiny model. Stops at ``<|im_end|>``.
    """
    start = int(sample.loss_mask.nonzero()[0])
    ids = sample.token_ids[:start]
    types = sample.mm_token_type_ids[:start]
    mm = sample.multi_modal_data
    pixels = None if mm is None else mm.pixel_values
    grid = None if mm is None else mm.image_grid_thw
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    merge = model.config.vision_config.spatial_merge_size
    new: list[int] = []
    for _ in range(max_new_tokens):
        positions = sample_position_ids(types, grid, spatial_merge_size=merge)[:, None]
        logits = model(
            ids[None], position_ids=positions, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=types[None]
        )
        nxt = int(logits[0, -1].argmax())
        if nxt == end_id:
            break
        new.append(nxt)
        ids = torch.cat([ids, torch.tensor([nxt])])
        types = torch.cat([types, torch.zeros(1, dtype=types.dtype)])
    return tokenizer.decode(new)


@dataclass(frozen=True)
class Probe:
    """One held-out question put to a checkpoint."""

    messages: list[dict]
    """The conversation, including the reference answer."""
    greedy: str
    """What the model answers on its own."""
    scores: ReplyScores
    """Teacher-forced per-token losses on the reference answer."""


def probe(model: Any, renderer: Any, conversation: Any, *, max_new_tokens: int = 16) -> Probe:
    """Put one held-out conversation (a ``Conversation`` with its reference answer) to ``model``."""
    sample = renderer.render(conversation.messages, tools=conversation.tools, sample_index=conversation.index)
    tokenizer = renderer.tokenizer
    return Probe(
        messages=conversation.messages,
        greedy=greedy_answer(model, sample, tokenizer, max_new_tokens=max_new_tokens),
        scores=teacher_forced(model, sample, tokenizer),
    )


def plot_probes(probes: Sequence[Probe]) -> Figure:
    """Per question: the image(s), the reference and greedy answers, and the reference tokens' losses."""
    fig = Figure(figsize=(12, 2.5 * len(probes)))
    grid = fig.add_gridspec(len(probes), 2, width_ratios=[1, 3.2], hspace=1.0, wspace=0.15)
    for k, probe in enumerate(probes):
        images, question, answer = _images_and_text(probe.messages)
        ax = fig.add_subplot(grid[k, 0])
        if images:
            ax.imshow(side_by_side(images), interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(textwrap.fill(question, 28), fontsize=8, loc="left")
        ax = fig.add_subplot(grid[k, 1])
        s = probe.scores
        colours = ["C2" if ok else "C3" for ok in s.correct]
        ax.bar(range(len(s.losses)), s.losses, color=colours)
        ax.set_xticks(range(len(s.targets)), [t.replace("\n", "\u21b5") for t in s.targets], fontsize=8, rotation=60)
        for i, (ok, p) in enumerate(zip(s.correct, s.predicted, strict=True)):
            if not ok:
                ax.text(i, s.losses[i], p.replace("\n", "\u21b5"), ha="center", va="bottom", fontsize=8, color="C3")
        ax.set_ylabel("loss (nats)")
        greedy = probe.greedy.replace("<think>\n\n</think>\n\n", "").strip()
        ax.set_title(f"reference: {answer!r}    greedy: {greedy!r}", fontsize=9, loc="left")
        if k == 0:
            handles = [Patch(color="C2", label="argmax = reference"), Patch(color="C3", label="argmax differs (shown)")]
            ax.legend(handles=handles, loc="upper left", fontsize=7, framealpha=0.8)
    return fig


def plot_task_accuracy(metrics: dict[str, float], *, title: str = "") -> Figure:
    """Held-out answer accuracy per task from ``evaluate`` (``eval_acc_<task>`` keys); chance on colour is 1/6."""
    tasks = sorted(k.removeprefix("eval_acc_") for k in metrics if k.startswith("eval_acc_"))
    values = [metrics[f"eval_acc_{t}"] for t in tasks]
    fig = Figure(figsize=(7, 2.8))
    ax = fig.add_subplot()
    bars = ax.bar(tasks, values, color=["C7" if t == "all" else "C0" for t in tasks])
    ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=8)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("accuracy (teacher-forced)")
    ax.set_title(
        title or f"held-out accuracy per task (eval loss {metrics.get('eval_loss', float('nan')):.3f})", fontsize=10
    )
    fig.tight_layout()
    return fig
