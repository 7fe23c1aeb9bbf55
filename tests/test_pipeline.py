"""The packing pipeline: accounting of every sample, exact resume, sharding, and the pass summary."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from renderers.errors import RenderError
from renderers.types import RenderedSample
from vlm_sft.data.collate import collate
from vlm_sft.data.pack import Pack
from vlm_sft.data.pipeline import EmptyPassError, PackingPipeline, summarize_pass
from vlm_sft.data.synthetic import SyntheticSource, compose_sample, random_spans

L = 40


class RandomSource:
    """Deterministic per index: random spans of 1..2L tokens; every 13th index fails to render."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.calls = n, seed, 0

    def __call__(self, index: int) -> RenderedSample:
        self.calls += 1
        if index % 13 == 5:
            raise RenderError("corrupt_image", "synthetic failure")  # the pipeline adds the index
        rng = random.Random(self.seed * 7919 + index)
        return compose_sample(random_spans(rng, max_tokens=2 * L), sample_index=index, seed=self.seed, pixel_dim=12)


def make(n=60, **kw) -> PackingPipeline:
    kw.setdefault("seq_len", L)
    kw.setdefault("pack_len", L)
    kw.setdefault("buffer_size", 8)
    return PackingPipeline(n, RandomSource(n, kw.pop("source_seed", 0)), **kw)


def key(pack: Pack) -> tuple:
    """Everything a pack holds, comparable (indices, row length, token values and pixel checksums)."""
    return (
        pack.sample_indices,
        pack.row_len,
        tuple((s.input_ids.tolist(), s.loss_mask.tolist(), s.num_patches) for s in pack.samples),
        tuple(float(s.pixel_values.sum()) for s in pack.samples if s.pixel_values is not None),
    )


@pytest.mark.parametrize("mode", ["cat", "bfd", "stack"])
def test_every_sample_is_packed_once_or_skipped_with_a_reason(mode):
    pipe = make(80, packing=mode, batch_size=3, epochs=1)
    packs = list(pipe)
    packed = [i for p in packs for row in p.sample_indices for i in row]
    skipped = pipe.skips.to_dict()
    assert len(packed) == len(set(packed)), "a sample was packed twice"
    assert pipe.samples_seen == 80 == len(packed) + pipe.skips.total
    assert skipped["corrupt_image"]["count"] == len([i for i in range(80) if i % 13 == 5])
    for reason, entry in skipped.items():  # examples name real skipped rows, never a packed one, with the detail
        rows = {e["row"] for e in entry["examples"]}
        assert rows and not rows & set(packed), reason
        assert all(e["detail"] for e in entry["examples"]), reason
    assert skipped["corrupt_image"]["examples"][0]["detail"] == "synthetic failure"
    assert pipe.accounting.packed == len(packed) and pipe.accounting.buffered == 0 and pipe.accounting.passes == 1
    assert set(skipped) <= {
        "corrupt_image",
        "truncated_final_turn",
        "truncated_no_trainable_tokens",
        "no_trainable_tokens",
        "too_short",
    }
    for p in packs:
        collate([p]).check()


def test_epochs_reshuffle_and_never_mix_in_one_pack():
    pipe = make(30, packing="cat", epochs=2, seed=4)
    rows = [[i for row in p.sample_indices for i in row] for p in pipe]
    accepted = sum(len(r) for r in rows) // 2
    ends = [sum(len(r) for r in rows[: k + 1]) for k in range(len(rows))]
    assert accepted in ends, "a pack holds samples of both epochs"
    split = ends.index(accepted) + 1
    first = [i for r in rows[:split] for i in r]
    second = [i for r in rows[split:] for i in r]
    assert sorted(first) == sorted(second) and first != second  # the same accepted samples, in another order
    assert pipe.samples_seen == 60 and pipe.epoch == 2


def test_state_is_small_and_refuses_another_configuration():
    pipe = make(packing="bfd", epochs=1)
    for _ in range(3):
        next(pipe)
    state = pipe.state_dict()
    text = json.dumps(state)  # plain ints and lists, never tensors
    assert len(text) < 2000
    other = make(packing="bfd", epochs=1, seed=1)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["cat", "bfd", "stack"]),
    seed=st.integers(0, 3),
    stop=st.integers(0, 40),
    buffer_size=st.integers(1, 12),
    budget=st.sampled_from([None, 48]),
)
def test_resume_yields_exactly_the_uninterrupted_stream(mode, seed, stop, buffer_size, budget):
    kw = dict(
        packing=mode, seed=seed, epochs=2, batch_size=3, buffer_size=buffer_size, max_image_patches_per_pack=budget
    )
    ref = [key(p) for p in make(24, **kw)]
    pipe = make(24, **kw)
    head = [key(p) for _, p in zip(range(stop), pipe, strict=False)]
    state = json.loads(json.dumps(pipe.state_dict()))
    resumed = make(24, **kw)
    resumed.load_state_dict(state)
    tail = [key(p) for p in resumed]
    assert head + tail == ref
    assert resumed.skips.to_dict() == make_pass_skips(kw)


def make_pass_skips(kw) -> dict:
    pipe = make(24, **kw)
    for _ in pipe:
        pass
    return pipe.skips.to_dict()


def test_resume_needs_a_deterministic_render_fn():
    pipe = make(packing="bfd", epochs=1, buffer_size=32)
    next(pipe)
    state = pipe.state_dict()
    assert state["packer"]["buffer"], "the test needs buffered samples"
    flaky = make(packing="bfd", epochs=1, buffer_size=32)
    flaky.render_fn = lambda i: (_ for _ in ()).throw(RenderError("corrupt_image", "now fails", sample_index=i))
    with pytest.raises(RuntimeError, match="deterministic"):
        flaky.load_state_dict(state)


def test_shards_cover_the_data_once():
    world = 3
    single = [key(p) for p in make(50, packing="bfd", epochs=1)]
    per_rank = [[key(p) for p in make(50, packing="bfd", epochs=1, rank=r, world_size=world)] for r in range(world)]
    indices = [i for packs in per_rank for k in packs for row in k[0] for i in row]
    assert len(indices) == len(set(indices))
    assert sorted(indices) == sorted(i for k in single for row in k[0] for i in row)


def test_a_pass_without_any_pack_is_an_error_not_an_endless_loop():
    class AllBad:
        def __call__(self, index):
            raise RenderError("corrupt_image", f"image {index} is broken")

    pipe = PackingPipeline(6, AllBad(), seq_len=L, pack_len=L, epochs=None)
    with pytest.raises(EmptyPassError, match="corrupt_image"):
        next(pipe)
    empty_shard = make(2, epochs=None, rank=2, world_size=3)  # 2 samples, 3 shards: shard 2 holds none
    with pytest.raises(EmptyPassError, match="no pack"):
        next(empty_shard)


def test_summary_accounts_for_the_whole_pass():
    src = SyntheticSource(64, distribution="short", seed=2)
    pipe = PackingPipeline(len(src), src, seq_len=512, pack_len=512, packing="bfd", buffer_size=64)
    summary = summarize_pass(pipe)
    assert (
        summary["samples_seen"]
        == 64
        == summary["samples_packed"] + sum(v["count"] for v in summary["skipped"].values())
    )
    assert summary["real_tokens"] + summary["padding_tokens"] == summary["packs"] * 512
    assert summary["real_tokens"] == sum(len(src(i)) - 1 for i in range(64))  # nothing skipped: every input packed
    assert summary["packing_efficiency"] == summary["real_tokens"] / (summary["packs"] * 512)
    assert (
        summary["patches_per_pack"]["min"]
        <= summary["patches_per_pack"]["median"]
        <= summary["patches_per_pack"]["max"]
    )
    assert summary["images"] == sum(src(i).num_images for i in range(64))
    json.dumps(summary)


def test_seq_len_longer_than_the_pack_is_refused():
    with pytest.raises(ValueError, match="seq_len"):
        make(seq_len=2 * L)


def test_truncation_runs_before_packing():
    src = SyntheticSource(40, distribution="long_tail", seed=1, pixel_dim=4)
    pipe = PackingPipeline(len(src), src, seq_len=256, pack_len=256, packing="cat", truncation="truncate")
    summary = summarize_pass(pipe)
    assert "longer_than_pack" not in summary["skipped"]
    assert summary["samples_packed"] > 0
    assert torch.tensor([len(src(i)) for i in range(40)]).max() > 257  # some samples were truncated
