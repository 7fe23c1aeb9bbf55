"""Weighted mixtures (``vlm_sft.data.mixture``): the draw's shares, each source read without replacement per pass, one
epoch's size, exact resume with a streamed source in the mix, per-source accounting and skip limits, and the errors
that name a source. Trainer-level parity (processes, workers, kill -9) is ``tests/test_mixture_train.py``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from vlm_sft.config import ConfigError, load_config
from vlm_sft.data import build as data_build
from vlm_sft.data.mixture import BLOCK, Mixture, MixturePart, SourceDraw
from vlm_sft.data.pipeline import IndexOrder, SkipFractionError


def test_draw_shares_match_the_weights_over_any_long_window():
    draw = SourceDraw([6, 3, 1], seed=0, stream=0)
    sources = [draw.source_at(q) for q in range(3000)]
    shares = [sources.count(s) / len(sources) for s in range(3)]
    assert shares == pytest.approx([0.6, 0.3, 0.1], abs=0.02)
    for blocks in range(1, 12):  # at every block boundary each count is within one sample of its share
        counts = draw.counts_before(blocks * BLOCK)
        assert all(abs(c - blocks * BLOCK * w) < 1 for c, w in zip(counts, (0.6, 0.3, 0.1), strict=True))
    for start in range(0, 2500, 97):  # and any window of two blocks is within a few percent
        window = sources[start : start + 2 * BLOCK]
        assert window.count(0) / len(window) == pytest.approx(0.6, abs=0.03)
    # The draw is seeded per stream: the same for the same stream, another order for another stream, and mixed
    # within each block (not 60% zeros first).
    assert sources == [SourceDraw([6, 3, 1], seed=0, stream=0).source_at(q) for q in range(3000)]
    assert sources[:BLOCK] != [SourceDraw([6, 3, 1], seed=0, stream=1).source_at(q) for q in range(BLOCK)]
    assert sources[:BLOCK] != sorted(sources[:BLOCK])


def test_uniform_weights_would_fail_the_share_check():
    """The control: a draw that ignored the weights misses 60/30/10 by far more than the 2 points allowed."""
    draw = SourceDraw([1, 1, 1], seed=0, stream=0)
    sources = [draw.source_at(q) for q in range(3000)]
    assert abs(sources.count(0) / 3000 - 0.6) > 0.2


class _Rows:
    """A render function that records which rows it was asked for."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, row: int):
        raise AssertionError("not rendered in this test")


def _mixture(sizes: dict[str, int], weights: dict[str, float], *, stream=0, streams=1, seed=0) -> Mixture:
    parts = [
        MixturePart(n, weights[n], IndexOrder(k, shuffle=True, seed=seed + i, rank=stream, world_size=streams), _Rows(n), k)
        for i, (n, k) in enumerate(sizes.items())
    ]  # fmt: skip
    return Mixture(parts, seed=seed, stream=stream, streams=streams)


def test_each_source_is_read_once_per_pass_and_reshuffled(caplog):
    mixture = _mixture({"big": 400, "small": 10}, {"big": 1, "small": 1})
    assert mixture.epoch_draws == 410  # one epoch: the rows of all sources
    with caplog.at_level(logging.INFO, logger="vlm_sft.data.mixture"):
        drawn = [mixture.source_of(mixture.index_at(0, p)) for p in range(410)]
    assert mixture.index_at(0, 410) is None
    small = [row for name, row in drawn if name == "small"]
    assert len(small) == pytest.approx(205, abs=1)  # equal weights: half the draws, ~20 passes over 10 rows
    passes = [small[i : i + 10] for i in range(0, 200, 10)]
    assert all(sorted(p) == list(range(10)) for p in passes)  # every pass reads every row once
    assert len({tuple(p) for p in passes}) > 1  # in a new order each pass
    assert "source 'small' starts its pass 2" in caplog.text
    big = [row for name, row in drawn if name == "big"]
    assert len(set(big)) == len(big)  # 205 of 400 rows: no row twice within a pass


def test_streams_split_each_source_and_an_epoch_reads_each_about_once_at_proportional_weights():
    """Over 3 streams, weights proportional to the sizes: one epoch is the 180 rows' worth of draws, and each source
    is read about once (to within the rounding of the streams' last, partial blocks), every row at most twice."""
    sizes = {"a": 120, "b": 60}
    seen: dict[str, list[int]] = {"a": [], "b": []}
    for stream in range(3):
        mixture = _mixture(sizes, {"a": 120, "b": 60}, stream=stream, streams=3)
        rows = [mixture.source_of(mixture.index_at(0, p)) for p in range(mixture.epoch_draws)]
        for name, row in rows:
            seen[name].append(row)
    assert sum(len(v) for v in seen.values()) == 180
    assert len(seen["a"]) == pytest.approx(120, abs=10) and len(set(seen["a"])) >= 110
    assert len(seen["b"]) == pytest.approx(60, abs=10) and len(set(seen["b"])) >= 50
    assert max(seen["a"].count(r) for r in range(120)) <= 2


def test_a_source_with_fewer_rows_than_streams_is_refused_naming_it():
    mixture = _mixture({"a": 50, "tiny": 2}, {"a": 1, "tiny": 1}, stream=2, streams=3)
    with pytest.raises(RuntimeError, match=r"'tiny'.*stream 2 of 3 has no rows of it"):
        for p in range(40):
            mixture.index_at(0, p)


# ------------------------------------------------------------------------------------- through the real pipeline


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mix")
    chat = [_chat(i, "text") for i in range(40)]
    (root / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    (root / "streamed").mkdir()
    (root / "streamed" / "part-0.jsonl").write_text("".join(json.dumps(_chat(i, "streamed")) + "\n" for i in range(30)))
    bad = [{"messages": [{"role": "user", "content": f"no reply {i}"}]} for i in range(20)]
    (root / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    (root / "empty.jsonl").write_text("")
    return root


def _chat(i: int, tag: str) -> dict:
    words = " ".join(["word"] * (3 + (7 * i) % 40))
    return {
        "messages": [
            {"role": "user", "content": f"{tag} {i}: {words}?"},
            {"role": "assistant", "content": f"{tag} answer {i}"},
        ]
    }


def _config(tmp_path: Path, data_dir: Path, tables: str, *extra: str):
    toml = tmp_path / "mix.toml"
    toml.write_text(
        f'[model]\nname_or_path = "tiny"\n[model.vlm]\n[data]\nseq_len = 128\npack_len = 256\nbfd_buffer = 16\n'
        f'[data.shapes]\nroot = "{tmp_path / "shapes"}"\nnum_train = 40\nnum_eval = 0\n{tables}'
    )
    return load_config(toml, list(extra))


def _table(source: str, weight: float, **keys: object) -> str:
    more = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
    return f'[[data.sources]]\nsource = "{source}"\nweight = {weight}\n{more}'


def _parts(cfg):
    processor = data_build.build_processor(cfg)
    return data_build.build_renderer(cfg, processor), data_build.load_sources(cfg)


def test_mixture_pipeline_resumes_exactly_with_a_streamed_source(tmp_path, data_dir):
    tables = (
        _table("shapes", 6)
        + _table(str(data_dir / "text.jsonl"), 3)
        + _table(str(data_dir / "streamed"), 1, streaming=True)
    )
    cfg = _config(tmp_path, data_dir, tables)
    renderer, sources = _parts(cfg)
    assert [p.name for p in sources.train.parts] == ["shapes", "text", "streamed"] and sources.train.rows is None

    def pipeline():
        return data_build.build_pipeline(cfg, sources.train, renderer, shard=1, num_shards=2, epochs=None)

    whole = pipeline()
    expected = [pack.sample_indices for _, pack in zip(range(14), whole, strict=False)]
    first = pipeline()
    got = [pack.sample_indices for _, pack in zip(range(6), first, strict=False)]
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints hold plain JSON
    resumed = pipeline()
    resumed.load_state_dict(state)
    got += [pack.sample_indices for _, pack in zip(range(8), resumed, strict=False)]
    assert got == expected
    names = {resumed.source_of(i)[0] for pack in expected for row in pack for i in row}
    assert names == {"shapes", "text", "streamed"}  # the packs mix sources
    acc = resumed.accounting
    assert sum(c.seen for c in acc.sources.values()) == acc.seen
    assert sum(c.packed for c in acc.sources.values()) == acc.packed


def test_per_source_accounting_balances_over_an_epoch(tmp_path, data_dir):
    tables = _table("shapes", 2) + _table(str(data_dir / "text.jsonl"), 1) + _table(str(data_dir / "bad.jsonl"), 1)
    cfg = _config(tmp_path, data_dir, tables)
    renderer, sources = _parts(cfg)
    pipeline = data_build.build_pipeline(cfg, sources.train, renderer, epochs=1)
    packs = list(pipeline)
    acc = pipeline.accounting
    acc.check()
    assert acc.seen == 100 and acc.buffered == 0  # one epoch: the 40 + 40 + 20 rows' worth of draws
    per = acc.to_dict()["sources"]
    assert per["bad"]["packed"] == 0 and per["bad"]["samples_skipped"] == per["bad"]["seen"] > 0
    assert set(per["bad"]["skipped"]) == {"no_assistant_turn"}
    assert all(e["row"] < 20 for e in per["bad"]["skipped"]["no_assistant_turn"]["examples"])  # the source's rows
    assert sum(p.num_trainable_tokens for p in packs) == sum(c["trainable_tokens"] for c in per.values())
    assert sum(p.num_real_tokens for p in packs) == sum(c["real_tokens"] for c in per.values())


def test_a_broken_small_source_stops_the_run_naming_it(tmp_path, data_dir):
    """A source whose every row fails, at 5% of the draws, under a 20% limit: the total stays under the limit, so
    only the per-source check can stop it, and its message names the source."""
    tables = _table(str(data_dir / "text.jsonl"), 19) + _table(str(data_dir / "bad.jsonl"), 1)
    cfg = _config(tmp_path, data_dir, tables, "--data.max_skip_fraction", "0.2", "--data.skip_check_after", "10")
    renderer, sources = _parts(cfg)
    pipeline = data_build.build_pipeline(cfg, sources.train, renderer, epochs=None, check_skips=True)
    with pytest.raises(SkipFractionError, match=r"data source 'bad': .* were skipped") as info:
        for _ in pipeline:
            pass
    acc = pipeline.accounting
    assert acc.skip_fraction < 0.2 < acc.sources["bad"].skip_fraction  # the total alone would not have stopped it
    assert "Fix the rows of 'bad'" in str(info.value)


def test_sources_that_cannot_be_used_are_named_before_any_model(tmp_path, data_dir):
    missing = _config(tmp_path, data_dir, _table("shapes", 1) + _table(str(tmp_path / "nope.jsonl"), 1, name="ocr"))
    with pytest.raises(ConfigError, match=r"data source 'ocr' .*nope.jsonl.* cannot be read"):
        data_build.load_sources(missing)
    empty = _config(tmp_path, data_dir, _table("shapes", 1) + _table(str(data_dir / "empty.jsonl"), 1))
    with pytest.raises(ConfigError, match=r"data source 'empty' .* has no rows; fill it or remove its table"):
        data_build.load_sources(empty)
    streamed = _table(str(data_dir / "streamed"), 1, streaming=True)
    with pytest.raises(ConfigError, match=r"train.epochs = 1.0 with the streamed source"):
        _config(tmp_path, data_dir, _table("shapes", 1) + streamed, "--train.epochs", "1", "--train.max_steps", "none")


def test_a_resume_with_other_weights_is_refused_before_the_model_naming_the_mixture(tmp_path, data_dir):
    from vlm_sft.trainer.batches import DataLayout, check_data_settings

    text = str(data_dir / "text.jsonl")
    saved_cfg = _config(tmp_path, data_dir, _table("shapes", 6) + _table(text, 3))
    renderer, sources = _parts(saved_cfg)
    pipeline = data_build.build_pipeline(saved_cfg, sources.train, renderer, epochs=None)
    next(pipeline)
    position = {"streams": {"0": pipeline.state_dict()}}
    layout = DataLayout(0, 1, 1, 1)
    check_data_settings(position, data_build.TrainPipelines(saved_cfg, sources.train, renderer), layout)  # same: ok
    changed = _config(tmp_path, data_dir, _table("shapes", 6) + _table(text, 4))
    pipelines = data_build.TrainPipelines(changed, data_build.load_sources(changed).train, renderer)
    with pytest.raises(ConfigError, match=r"mixture shapes = 6, text = 3; this config mixes shapes = 6, text = 4"):
        check_data_settings(position, pipelines, layout)


def test_a_mixture_config_survives_its_saved_config_json(tmp_path, data_dir):
    """The run writes ``cfg.to_dict()`` to ``config.json``: its default ``data.source`` beside the tables must read
    back (a user's explicit ``data.source`` beside them is still refused, tests/test_mixture_example.py)."""
    from vlm_sft.config import RunConfig

    cfg = _config(tmp_path, data_dir, _table("shapes", 2) + _table(str(data_dir / "text.jsonl"), 1))
    assert RunConfig.model_validate_json(cfg.model_dump_json()) == cfg
