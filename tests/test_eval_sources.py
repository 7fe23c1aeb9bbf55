"""Per-source eval of several held-out sources (``[[data.eval_sources]]``): ``eval_loss/<name>`` and ``eval_acc/<name>``
of the mixed held-out set equal the eval of each source alone, their token-weighted mean is the mixed ``eval_loss``,
two ranks report what one does, and a single held-out source has no per-source keys.

The data goes the trainer's way: jsonl files in the ``messages`` format, a TOML config through ``load_config``,
``load_sources`` (a ``ConcatSource`` and its ``eval_groups``), ``build_eval_batches`` and ``evaluate`` on the tiny
model over the tiny processor. The two sources differ in content and length and share a packed row: a sample charged
to the wrong source moves both per-source losses (the controls show it), and a sample's span cut at the wrong token
breaks the hand-worked figures or the token-weighted sum.
"""

from __future__ import annotations

import copy
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from test_evaluate import HAND_EVAL_LOSS, HAND_SAMPLES, FakeGroup, hand_stub, packed_batch

from vlm_sft.config import RunConfig, load_config
from vlm_sft.data import build as data_build
from vlm_sft.data.batch import PackedBatch
from vlm_sft.parallel.env import DistEnv
from vlm_sft.trainer import evaluate as evaluate_module
from vlm_sft.trainer.evaluate import build_eval_batches, evaluate, format_eval

CPU = torch.device("cpu")
ONE_RANK = DistEnv(rank=0, world_size=1, local_rank=0, device=CPU)
NAMES = ("chat", "story")
"""The two held-out sources, in config order (``chat`` short question-answer rows, ``story`` longer replies)."""
REL = 1e-6


def test_per_source_loss_and_accuracy_match_the_hand_worked_case():
    """``test_evaluate``'s hand-worked batch split over sources: A alone in ``x``; B and C in ``y``, in two rows; D (no
    trainable token) alone in ``z``, which then reports nothing rather than a loss of 0."""
    groups = {10: "x", 11: "y", 12: "y", 13: "z"}
    out = evaluate(hand_stub(), [packed_batch(HAND_SAMPLES)], env=ONE_RANK, sample_groups=groups)
    wrong = math.log(math.e + 2)  # nll of a wrong argmax (test_evaluate: vocabulary {0, 1, 2}, one-hot logits)
    per_source = {"eval_loss/x", "eval_loss/y", "eval_acc/x", "eval_acc/y"}
    assert out.keys() == {"eval_loss", "eval_tokens", "eval_acc_all", *per_source}
    assert out["eval_loss/x"] == pytest.approx(wrong - 0.5, abs=1e-6)  # A: one wrong, one right
    assert out["eval_loss/y"] == pytest.approx(wrong - 1, abs=1e-6)  # B, C: five right
    assert (out["eval_acc/x"], out["eval_acc/y"]) == (0.0, 1.0)
    assert out["eval_loss"] == pytest.approx(HAND_EVAL_LOSS, abs=1e-6)
    assert (2 * out["eval_loss/x"] + 5 * out["eval_loss/y"]) / 7 == pytest.approx(out["eval_loss"], abs=1e-6)


def _turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _chat_rows() -> list[dict]:
    return [
        {"messages": [_turn("user", f"What is {a} plus {a + 2}?"), _turn("assistant", str(2 * a + 2))]}
        for a in range(7)
    ]


def _story_rows() -> list[dict]:
    lines = ["The small red fox ran over a hill.", "Then it slept under an old tree.", "A river ran by the tree."]
    return [
        {
            "messages": [
                _turn("system", "You tell short stories."),
                _turn("user", f"Tell story number {k}."),
                _turn("assistant", f"Story {k}: " + " ".join(lines[k % 3 :] + lines[: k % 3])),
            ]
        }
        for k in range(5)
    ]


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _config(folder: Path, name: str, eval_tables: str) -> RunConfig:
    """A tiny-model config training on ``chat.jsonl`` whose held-out data is ``eval_tables`` (TOML)."""
    text = f"""
[model]
name_or_path = "tiny"
dtype = "float32"

[data]
source = "{folder / "chat.jsonl"}"
seq_len = 192
pack_len = 256
{eval_tables}

[train]
device = "cpu"
"""
    path = folder / f"{name}.toml"
    path.write_text(text)
    return load_config(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, processor):
    """The files, the configs (both sources, each alone), the renderer and one seeded tiny model."""
    from vlm_sft.model import build_model, tiny_qwen3_5_config

    folder = tmp_path_factory.mktemp("eval_sources")
    files = {
        "chat": _write_jsonl(folder / "chat.jsonl", _chat_rows()),
        "story": _write_jsonl(folder / "story.jsonl", _story_rows()),
    }
    tables = "".join(f'\n[[data.eval_sources]]\nsource = "{files[n]}"\nname = "{n}"\n' for n in NAMES)
    configs = {"mixed": _config(folder, "mixed", tables)}
    for n in NAMES:  # data.eval_source sits in [data]: before the tables would be, after source
        configs[n] = _config(folder, n, f'eval_source = "{files[n]}"')
    renderer = data_build.build_renderer(configs["mixed"], processor)
    torch.manual_seed(0)
    model = build_model(tiny_qwen3_5_config(initializer_range=0.3)).eval()
    return configs, renderer, model, int(processor.tokenizer.pad_token_id)


def _held_out(setup, which: str, env: DistEnv = ONE_RANK) -> tuple[data_build.DataSources, list[PackedBatch]]:
    configs, renderer, _, pad_id = setup
    sources = data_build.load_sources(configs[which])
    return sources, build_eval_batches(configs[which], sources, renderer, env, pad_id)


def _evaluate(setup, which: str, groups: dict[int, str] | None = None) -> dict[str, float]:
    sources, batches = _held_out(setup, which)
    return evaluate(setup[2], batches, env=ONE_RANK, sample_tasks=sources.eval_tasks, sample_groups=groups)


@pytest.fixture(scope="module")
def alone(setup) -> dict[str, dict[str, float]]:
    """The eval of each source alone (``data.eval_source``): the reference for its per-source keys."""
    return {n: _evaluate(setup, n) for n in NAMES}


def test_per_source_eval_equals_each_source_alone(setup, alone):
    sources, batches = _held_out(setup, "mixed")
    assert sorted(set(sources.eval_groups.values())) == sorted(NAMES)
    assert len(sources.eval_groups) == len(_chat_rows()) + len(_story_rows())
    shared = [ix for b in batches for ix in b.sample_indices if len({sources.eval_groups[i] for i in ix}) == 2]
    assert shared, "no packed row holds samples of both sources: the spans inside a row would go untested"
    out = evaluate(setup[2], batches, env=ONE_RANK, sample_tasks=sources.eval_tasks, sample_groups=sources.eval_groups)
    assert {k for k in out if "/" in k} == {f"eval_{m}/{n}" for m in ("loss", "acc") for n in NAMES}
    for n in NAMES:
        assert out[f"eval_loss/{n}"] == pytest.approx(alone[n]["eval_loss"], rel=REL), n
        assert out[f"eval_acc/{n}"] == pytest.approx(alone[n]["eval_acc_all"], rel=REL), n
    tokens = {n: alone[n]["eval_tokens"] for n in NAMES}
    assert out["eval_tokens"] == sum(tokens.values())
    weighted = sum(out[f"eval_loss/{n}"] * tokens[n] for n in NAMES) / sum(tokens.values())
    assert weighted == pytest.approx(out["eval_loss"], rel=REL)
    line = format_eval(7, out)
    assert f"; per source chat={out['eval_loss/chat']:.3f} story={out['eval_loss/story']:.3f}" in line, line


def test_a_single_source_has_no_per_source_keys(setup, alone):
    sources, _ = _held_out(setup, "chat")
    assert sources.eval_groups == {}
    out = _evaluate(setup, "chat", sources.eval_groups)
    assert out == alone["chat"]  # eval_groups = {}: exactly the output without sample_groups
    assert set(out) == {"eval_loss", "eval_tokens", "eval_acc_all"}
    assert "per source" not in format_eval(7, out)


def test_controls_wrong_groups_change_the_per_source_losses(setup, alone):
    """The comparison can fail: the sources' losses are far apart, so every sample charged to the first source (or
    the names swapped) misses the sources' own losses by far more than the tolerance."""
    sources, _ = _held_out(setup, "mixed")
    chat, story = (alone[n]["eval_loss"] for n in NAMES)
    assert abs(chat - story) > 100 * REL * max(chat, story)
    lumped = _evaluate(setup, "mixed", {i: "chat" for i in sources.eval_groups})
    assert "eval_loss/story" not in lumped
    assert lumped["eval_loss/chat"] == pytest.approx(lumped["eval_loss"], rel=REL)
    assert lumped["eval_loss/chat"] != pytest.approx(chat, rel=100 * REL)
    swap = {"chat": "story", "story": "chat"}
    swapped = _evaluate(setup, "mixed", {i: swap[n] for i, n in sources.eval_groups.items()})
    assert swapped["eval_loss/chat"] != pytest.approx(chat, rel=100 * REL)
    assert swapped["eval_loss/chat"] == pytest.approx(story, rel=REL)


def test_two_ranks_report_what_one_does(setup, monkeypatch):
    """Each rank scores its own packs; the per-source tallies ride the one sum all-reduce (same layout on both)."""
    sources, _ = _held_out(setup, "mixed")
    one = _evaluate(setup, "mixed", sources.eval_groups)
    group = FakeGroup(2)
    monkeypatch.setattr(evaluate_module, "all_reduce", group.all_reduce)
    models = [copy.deepcopy(setup[2]) for _ in range(2)]

    def rank(r: int) -> dict[str, float]:
        env = DistEnv(rank=r, world_size=2, local_rank=r, device=CPU)
        _, batches = _held_out(setup, "mixed", env)
        return evaluate(models[r], batches, env=env, sample_tasks=sources.eval_tasks, sample_groups=sources.eval_groups)

    with ThreadPoolExecutor(2) as pool:
        results = [f.result(timeout=60) for f in [pool.submit(rank, r) for r in (0, 1)]]
    assert group.calls[0] == group.calls[1] and [op for op, _ in group.calls[0]] == ["max", "sum"]
    for out in results:
        assert out.keys() == one.keys()
        for key, value in one.items():
            assert out[key] == pytest.approx(value, rel=REL), key
