"""Property-based fuzzing of the whole data path, as the trainer builds it: random jsonl rows with image files beside
them -> ``load_conversations`` -> ``build_pipeline`` (render -> truncate -> shift -> pack, each of bfd / cat / stack)
-> ``summarize_pass`` -> ``collate`` of every pack.

The rows are what users' files hold: messages and ShareGPT rows, string and block content, system / tool turns,
assistant turns with ``tool_calls`` and reasoning, ``tools`` columns, unicode (RTL, emoji, control characters),
control-token strings typed in text, 0-4 images per row in many modes, sizes and formats, corrupt / truncated /
missing image files, paths outside the data folder, over-long samples, rows with no assistant turn, malformed lines.

Properties, for every generated dataset and packing mode:

- no exception leaves the pipeline: every bad row is a counted skip with a reason;
- the accounting balances: seen == rows == packed + skipped, and every row index is in exactly one pack or skip;
- every packed segment is its row's rendering, cut and shifted (inputs, targets, loss mask, types, pixels);
- in every collated batch: ``<|image_pad|>`` inputs == sum(t*h*w) / merge**2 over the grids; ``mm_token_type_ids``
  is 1 exactly at ``<|image_pad|>`` inputs; each row's ``seq_lens`` sum to the row length; nothing is trained on
  padding, image / vision-marker targets or ``<|im_start|>``; ``PackedBatch.check()`` holds;
- a rendered row opens and closes as many turns and vision blocks as it has (a typed control string never becomes
  a control token).

Profiles: the default suite runs ``DEFAULT_EXAMPLES`` derandomized examples (reproducible in CI, a few seconds).
``VLM_SFT_FUZZ_EXAMPLES=2000`` runs that many with a random seed (hypothesis prints the seed and the falsifying
dataset; ``--hypothesis-seed=N`` replays a run). Four bugs this test found (a lone surrogate in text, an
image ``{"bytes": ...}`` that is not bytes, an integer past Python's 4300-digit limit, a value nested ~600 levels
deep: each left the pipeline with an exception) are fixed, each now one counted skip, and held by the tests at the
end; the generator does not draw those inputs.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fuzz_rows import MALFORMED, OUTSIDE, ROOT, Files, dataset, nested, run_settings
from hypothesis import HealthCheck, given, note, settings
from PIL import Image

from renderers.types import IMAGE_TOKEN_TYPE
from vlm_sft.config import load_config
from vlm_sft.data.accounting import DataAccounting
from vlm_sft.data.batch import PackedBatch
from vlm_sft.data.build import build_pipeline, build_processor, build_renderer
from vlm_sft.data.collate import collate
from vlm_sft.data.pack import Pack
from vlm_sft.data.pipeline import summarize_pass
from vlm_sft.data.sources import load_conversations, render_fn

DEFAULT_EXAMPLES = 50
"""Examples in the default suite (three packing modes each)."""
EXAMPLES_ENV = "VLM_SFT_FUZZ_EXAMPLES"
"""Set to a number to run that many examples with a random seed (the deep profile)."""
_DEEP = int(os.environ.get(EXAMPLES_ENV) or 0)
FUZZ_SETTINGS = settings(
    max_examples=_DEEP or DEFAULT_EXAMPLES,
    derandomize=not _DEEP,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ------------------------------------------------------------------------------------------------------ helpers


def write_dataset(root: Path, lines: list[bytes], files: Files) -> Path:
    """The jsonl and its files under ``root/data``, outside files under ``root/outside``; returns the jsonl path."""
    data, outside = root / "data", root / "outside"
    for folder, entries in ((data, files.inside), (outside, files.outside)):
        for name, payload in entries.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(payload)
    (data / "sub").mkdir(parents=True, exist_ok=True)
    outside.mkdir(exist_ok=True)
    for name, target in files.links.items():
        (data / name).symlink_to(outside / target)
    path = data / "rows.jsonl"
    subst = {ROOT.encode(): str(data).encode(), OUTSIDE.encode(): str(outside).encode()}
    text = files.eol.join(lines) + (files.eol if files.final_newline else b"")
    for key, value in subst.items():
        text = text.replace(key, value)
    path.write_bytes(text)
    return path


def row_shape(line: bytes) -> bool:
    """Whether ``line`` is a JSON object with a ``messages`` or ``conversations`` key (what names a file's shape)."""
    try:
        row = json.loads(line.removeprefix(b"\xef\xbb\xbf"))
    except (ValueError, RecursionError):
        return False
    return isinstance(row, dict) and ("messages" in row or "conversations" in row)


_BUILT: dict[tuple, tuple] = {}


def processor_and_renderer(cfg) -> tuple:
    """The run's processor and renderer (built once per rendering setting, so the image cache carries over)."""
    d = cfg.data
    key = (d.loss_on, d.special_text, d.enable_thinking)
    if key not in _BUILT:
        processor = build_processor(cfg)
        _BUILT[key] = (processor, build_renderer(cfg, processor))
    return _BUILT[key]


@dataclass(frozen=True)
class Ids:
    """Token ids the checks need."""

    image_pad: int
    vision: tuple[int, ...]
    im_start: int
    im_end: int
    pad: int

    @classmethod
    def of(cls, tokenizer) -> Ids:
        tid = tokenizer.convert_tokens_to_ids
        return cls(
            image_pad=tid("<|image_pad|>"),
            vision=(tid("<|vision_start|>"), tid("<|vision_end|>"), tid("<|image_pad|>")),
            im_start=tid("<|im_start|>"),
            im_end=tid("<|im_end|>"),
            pad=tokenizer.pad_token_id,
        )


def check_batch(batch: PackedBatch, pack: Pack, ids: Ids, merge: int) -> None:
    """The collated batch's invariants, checked from its own tensors (independently of ``PackedBatch.check``)."""
    b, length = batch.shape
    inputs, targets, mask, types = batch.input_ids, batch.target_ids, batch.loss_mask, batch.mm_token_type_ids
    grids = batch.image_grid_thw
    slots = int(grids.prod(-1).sum()) // merge**2 if grids is not None else 0
    assert int((inputs == ids.image_pad).sum()) == slots, "<|image_pad|> inputs != sum(t*h*w) / merge**2"
    if grids is not None:
        assert bool((grids.prod(-1) % merge**2 == 0).all()), f"a grid not divisible by merge**2: {grids.tolist()}"
        assert batch.num_patches == int(grids.prod(-1).sum()), "pixel rows != sum(t*h*w)"
    expected_types = torch.where(inputs == ids.image_pad, IMAGE_TOKEN_TYPE, 0)
    assert torch.equal(types, expected_types), "mm_token_type_ids is not 1 exactly at image pads"
    real = torch.zeros(b, length, dtype=torch.bool)
    if batch.seq_lens is not None:
        ends = batch.seq_lens.cumsum(0)
        for r in range(b):
            row_segments = batch.seq_lens[(ends > r * length) & (ends <= (r + 1) * length)]
            assert int(row_segments.sum()) == length, f"row {r}: seq_lens sum to {int(row_segments.sum())}"
            used = sum(len(s) for s in pack.rows[r])
            assert [int(n) for n in row_segments[: len(pack.rows[r])]] == [len(s) for s in pack.rows[r]]
            real[r, :used] = True
    else:
        assert pack.stacked and batch.attention_mask is not None
        for r, row in enumerate(pack.rows):
            real[r, : len(row[0])] = True
        assert torch.equal(batch.attention_mask, real), "attention mask != the rows' real tokens"
    assert not bool(mask[~real].any()), "loss on padding"
    assert bool((inputs[~real] == ids.pad).all()) and not bool(types[~real].any()), "padding is not <|endoftext|>"
    never = torch.isin(targets, torch.tensor([*ids.vision, ids.im_start]))
    assert not bool(mask[never].any()), "a vision marker, image slot or <|im_start|> is trained as a target"
    assert batch.num_trainable_tokens == int(mask.sum()) == pack.num_trainable_tokens
    assert batch.num_real_tokens == int(real.sum()) == pack.num_real_tokens
    batch.check()


def check_segments(batch: PackedBatch, pack: Pack, render, seq_len: int, ids: Ids) -> None:
    """Every segment is its row rendered again on its own, cut to at most ``seq_len`` inputs and shifted."""
    patch_start = 0
    for r, row in enumerate(pack.rows):
        start = 0
        for s in row:
            ref = render(s.sample_index)
            n = len(s)
            full = len(ref) - 1
            assert n <= min(full, seq_len), f"row {s.sample_index}: {n} inputs of {full}, seq_len {seq_len}"
            seg = slice(start, start + n)
            assert torch.equal(batch.input_ids[r, seg], ref.token_ids[:n]), f"row {s.sample_index}: inputs differ"
            assert torch.equal(batch.target_ids[r, seg], ref.token_ids[1 : n + 1]), f"row {s.sample_index}: targets"
            assert torch.equal(batch.loss_mask[r, seg], ref.loss_mask[1 : n + 1]), f"row {s.sample_index}: loss mask"
            assert torch.equal(batch.mm_token_type_ids[r, seg], ref.mm_token_type_ids[:n])
            tokens = ref.token_ids
            # every turn opens and closes, every image block too: a typed control string never became a token
            assert int((tokens == ids.im_start).sum()) == int((tokens == ids.im_end).sum()), "unbalanced turns"
            vs, ve = (int((tokens == v).sum()) for v in ids.vision[:2])
            assert vs == ve == ref.num_images, (
                f"row {s.sample_index}: {vs} / {ve} vision markers, {ref.num_images} images"
            )
            mm = ref.multi_modal_data
            kept = [p for p in (mm.placeholders if mm else ()) if p.end <= n]
            rows_kept = int(mm.image_grid_thw[: len(kept)].prod(-1).sum()) if kept else 0
            assert s.num_images == len(kept) and s.num_patches == rows_kept
            if kept:
                got = batch.pixel_values[patch_start : patch_start + rows_kept]
                assert torch.equal(got, mm.pixel_values[:rows_kept]), f"row {s.sample_index}: pixels out of order"
            patch_start += rows_kept
            start += n
    assert patch_start == batch.num_patches


def run_mode(cfg, source, renderer, ids: Ids, merge: int, n_rows: int) -> dict[int, str]:
    """One pass of ``cfg.data.packing`` through ``summarize_pass``, every pack collated and checked; returns where
    each row went (``"packed"`` or its skip reason)."""
    pipeline = build_pipeline(cfg, source, renderer, epochs=1)
    pipeline.accounting.skips.max_examples = n_rows  # keep every skipped row, not the first few per reason
    packs: list[Pack] = []
    pop = pipeline.packer.pop

    def recording_pop() -> Pack | None:
        pack = pop()
        if pack is not None:
            packs.append(pack)
        return pack

    pipeline.packer.pop = recording_pop
    summary = summarize_pass(pipeline)  # any exception here is a bug: bad rows must become counted skips

    reasons = {e["row"]: reason for reason, info in summary["skipped"].items() for e in info["examples"]}
    skipped = [e["row"] for info in summary["skipped"].values() for e in info["examples"]]
    packed = [i for p in packs for s in p.samples for i in [s.sample_index]]
    assert summary["samples_seen"] == n_rows, f"{summary['samples_seen']} seen of {n_rows} rows"
    assert summary["samples_packed"] == len(packed) and summary["packs"] == len(packs)
    assert summary["samples_seen"] == summary["samples_packed"] + sum(v["count"] for v in summary["skipped"].values())
    assert sorted(skipped + packed) == list(range(n_rows)), f"rows lost or doubled: packed {packed}, skipped {skipped}"
    assert all(reason and isinstance(reason, str) for reason in summary["skipped"])
    assert summary["real_tokens"] == sum(p.num_real_tokens for p in packs)
    assert summary["images"] == sum(p.num_images for p in packs)

    render = render_fn(source, renderer)
    budget = cfg.data.max_image_patches_per_pack
    for pack in packs:
        assert budget is None or pack.num_patches <= budget, f"{pack.num_patches} patches, budget {budget}"
        batch = collate([pack], pad_id=ids.pad, spatial_merge_size=merge)  # as the trainer's loader does
        check_batch(batch, pack, ids, merge)
        check_segments(batch, pack, render, cfg.data.seq_len, ids)
    return {**reasons, **dict.fromkeys(packed, "packed")}


# -------------------------------------------------------------------------------------------------------- tests


@FUZZ_SETTINGS
@given(data=dataset(), overrides=run_settings())
def test_random_datasets_through_the_whole_data_path(data, overrides):
    lines, files = data
    note(f"overrides: {overrides}")
    note("rows:\n" + "\n".join(repr(line) for line in lines))
    # the config a run of each mode loads (a vision budget only applies to packed rows: stack refuses it)
    cfgs = {
        mode: load_config(
            None, [*(o for o in overrides if mode != "stack" or "max_image" not in o), f"--data.packing={mode}"]
        )
        for mode in ("bfd", "cat", "stack")
    }
    processor, renderer = processor_and_renderer(cfgs["bfd"])
    ids = Ids.of(processor.tokenizer)
    merge = int(processor.image_processor.merge_size)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_dataset(Path(tmp), lines, files)
        if not any(row_shape(line) for line in lines):  # a file, not a row, the trainer cannot use: an error
            with pytest.raises(ValueError, match="no 'messages' or 'conversations' column"):
                load_conversations(path, cache_dir=str(Path(tmp) / "cache"))
            return
        source = load_conversations(path, cache_dir=str(Path(tmp) / "cache"))
        assert len(source) == len(lines)
        went = {mode: run_mode(cfg, source, renderer, ids, merge, len(lines)) for mode, cfg in cfgs.items()}
    # which rows a pass keeps, and why it skips the others, does not depend on how it packs them; stack (no vision
    # budget) also keeps the rows whose own images exceed the budget
    assert went["bfd"] == went["cat"]
    over = {row for row, reason in went["bfd"].items() if reason == "image_patches_over_budget"}
    assert {row: r for row, r in went["bfd"].items() if row not in over} == {
        row: r for row, r in went["stack"].items() if row not in over
    }
    assert all(went["stack"][row] == "packed" for row in over)


def test_the_checks_fail_on_a_broken_batch(tmp_path, monkeypatch):
    """The batch checks can fail: a type id off by one position, and a skip the accounting lost."""
    cfg = load_config(None, ["--data.seq_len=96", "--data.pack_len=96"])
    processor, renderer = processor_and_renderer(cfg)
    ids, merge = Ids.of(processor.tokenizer), int(processor.image_processor.merge_size)
    image = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(image, "PNG")
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "?"}]}, {"role": "assistant", "content": "Red."}]}  # fmt: skip
    lines = [json.dumps(row).encode(), b"{not json"]
    path = write_dataset(tmp_path, lines, Files({"a.png": image.getvalue()}, {}, {}))
    source = load_conversations(path, cache_dir=str(tmp_path / "cache"))
    assert run_mode(cfg, source, renderer, ids, merge, 2) == {0: "packed", 1: "malformed_row"}

    pack = next(iter(build_pipeline(cfg, source, renderer, epochs=1, packing="cat")))
    batch = collate([pack], pad_id=ids.pad, spatial_merge_size=merge)
    shifted = dataclasses.replace(batch, mm_token_type_ids=batch.mm_token_type_ids.roll(1, dims=1))
    with pytest.raises(AssertionError, match="mm_token_type_ids"):
        check_batch(shifted, pack, ids, merge)
    with monkeypatch.context() as m:
        m.setattr(DataAccounting, "count_skip", lambda self, err, source=None, row=None: None)  # a lost skip
        with pytest.raises(AssertionError, match="accounting"):
            run_mode(cfg, source, renderer, ids, merge, 2)


def _render_rows(tmp_path: Path, lines: list[bytes], *, max_examples: int = 5) -> dict:
    """``summarize_pass`` of one bfd pass over ``lines`` (the call a data report makes)."""
    cfg = load_config(None, ["--data.seq_len=96", "--data.pack_len=96"])
    _, renderer = processor_and_renderer(cfg)
    path = write_dataset(tmp_path, lines, Files({}, {}, {}))
    source = load_conversations(path, cache_dir=str(tmp_path / "cache"))
    pipeline = build_pipeline(cfg, source, renderer, epochs=1, packing="bfd")
    pipeline.accounting.skips.max_examples = max_examples
    return summarize_pass(pipeline)


def test_malformed_lines_are_skipped_with_their_reason(tmp_path):
    """The generator's malformed lines, each with the skip it must become (a readable failure when one regresses)."""
    ok = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    lines = [json.dumps(ok).encode(), *MALFORMED]
    summary = _render_rows(tmp_path, lines, max_examples=len(lines))
    assert summary["samples_packed"] == 1 and summary["samples_seen"] == len(lines)
    got = {e["row"]: reason for reason, info in summary["skipped"].items() for e in info["examples"]}
    assert [got[row] for row in range(1, len(lines))] == list(MALFORMED.values())


# ---------------------------------------------------------------------------- bugs it found, fixed


OK_LINE = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}).encode()
"""A usable row, so a file whose other row is bad still has a messages column."""


def assert_one_skip(summary: dict, reason: str) -> None:
    assert summary["samples_seen"] == 2 and summary["samples_packed"] == 1
    assert [e["row"] for info in summary["skipped"].values() for e in info["examples"]] == [1]
    assert list(summary["skipped"]) == [reason]


@pytest.mark.parametrize(
    "line",
    [
        b'{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "yo"}]}',
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a \\udfff b"}]}',
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "\\ud83d"}]}',
    ],
    ids=["user", "assistant", "reasoning"],
)
def test_lone_surrogate_in_text_is_a_skip(tmp_path, line):
    """JSON may escape a lone UTF-16 surrogate (``"\\ud800"``, half of an emoji cut by a JavaScript writer); Python
    reads it into a str the tokenizer refuses with a TypeError, which leaves the pipeline (training stops)."""
    assert_one_skip(_render_rows(tmp_path, [OK_LINE, line]), "lone_surrogate")


@pytest.mark.parametrize("value", ['"iVBORw0KGgo="', "[300]", "-1", '{"a": 1}'])
def test_image_dict_with_non_bytes_is_a_skip(tmp_path, value):
    """An image ``{"bytes": ...}`` read from JSON holds a string or numbers, never bytes; ``read_image_source`` calls
    ``bytes(data)``, which raises TypeError / ValueError out of the pipeline instead of a ``bad_image_source`` skip."""
    line = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "image": {"bytes": %s}}'
    assert_one_skip(_render_rows(tmp_path, [OK_LINE, (line % value).encode()]), "bad_image_source")


def test_integer_literal_past_the_conversion_limit_is_a_malformed_row(tmp_path):
    """``json.loads`` refuses an integer of more than 4300 digits with a plain ValueError (not JSONDecodeError), which
    ``json_rows._jsonl_records`` does not catch: the whole file fails to load, not one ``malformed_row``."""
    line = b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ' + b"7" * 5000 + b"}]}"
    assert_one_skip(_render_rows(tmp_path, [OK_LINE, line], max_examples=2), "malformed_row")


@pytest.mark.parametrize("where", ["tool_arguments", "message_key"])
def test_deeply_nested_value_is_a_skip(tmp_path, where):
    """A value nested 600 deep loads (``json.loads`` and ``json_rows`` allow about 1000 levels) but
    ``renderers.content.map_strings`` recurses two frames per level: a RecursionError leaves the pipeline."""
    deep = nested(600, "x")
    if where == "tool_arguments":
        call = {"function": {"name": "f", "arguments": {"a": deep}}}
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": [call]}]
    else:
        messages = [{"role": "user", "content": "q", "meta": deep}, {"role": "assistant", "content": "a"}]
    line = json.dumps({"messages": messages}).encode()
    assert_one_skip(_render_rows(tmp_path, [OK_LINE, line]), "nested_too_deeply")
