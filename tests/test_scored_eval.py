"""Scored held-out sources through the eval path the trainer and ``vlm_sft.evaluate`` share
(``trainer.scored_eval.evaluate_scores``), with the model's replies stubbed: a reply equal to the reference scores
1.0 on every metric, a wrong one 0.0; thinking replies are scored after their think block, and one cut off inside it
counts as unparsed. Each source is read from rows in its benchmark's schema through the data layer."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from vlm_sft.data.schemas import RowMapping
from vlm_sft.data.sources import load_conversations
from vlm_sft.parallel.env import DistEnv
from vlm_sft.trainer import scored_eval
from vlm_sft.trainer.scored_eval import ScoredSource, evaluate_scores, scored_prompts, summarize

ONE_PROCESS = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

SOURCES = {
    "exact_match": ({"messages": [{"role": "user", "content": "Colour?"}, {"role": "assistant", "content": "Red."}]},
                    "Red.", "Blue."),
    "anls": ({"question": "Date?", "answers": ["1 May 2020", "May 1, 2020"], "image": "red.png"}, "1 may 2020",
             "12 June"),
    "relaxed_accuracy": ({"query": "Peak?", "label": ["12.0"], "image": "red.png"}, "12.4", "14"),
    "vqa_accuracy": ({"question": "Colour?", "answers": ["red"] * 7 + ["crimson"] * 3, "image": "red.png"}, "Red",
                     "blue"),
    "multiple_choice": ({"question": "Shape?", "options": ["circle", "square"], "answer": 1, "image": "red.png"},
                        "B", "A"),
}  # fmt: skip
"""metric -> (a row in its benchmark's schema, a right reply, a wrong reply)."""


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, ScoredSource]:
    folder = tmp_path_factory.mktemp("scored")
    Image.new("RGB", (64, 64), "red").save(folder / "red.png")
    out = {}
    for metric, (row, _, _) in SOURCES.items():
        path = folder / f"{metric}.jsonl"
        path.write_text(json.dumps(row) + "\n")
        source = load_conversations(path, cache_dir=str(folder / "cache"), mapping=RowMapping())
        out[metric] = ScoredSource(metric, source, metric, thinking=False, max_new_tokens=8)
    return out


def stub_generate(tokenizer, replies: dict[int, str]):
    """``generation.generate`` answering each prompt sample with the reply of its object id."""

    def generate(model, samples, env, **kwargs):
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        return [[*tokenizer.encode(replies[id(s)], add_special_tokens=False), end] for s in samples]

    return generate


def ask(sources, renderer, monkeypatch, pick: int, *, thinking: str = "") -> dict[str, float]:
    prompts = {name: scored_prompts(s, renderer)[0] for name, s in sources.items()}
    replies = {id(p.sample): thinking + SOURCES[name][pick] for name, asked in prompts.items() for p in asked}
    monkeypatch.setattr(scored_eval, "generate", stub_generate(renderer.tokenizer, replies))
    metrics, rows = evaluate_scores(None, prompts, ONE_PROCESS, renderer.tokenizer, token_budget=4096)
    assert {r["source"] for r in rows} == set(sources) and summarize(rows).keys() == set(sources)
    return metrics


def test_the_reference_scores_one_and_a_wrong_reply_zero_on_every_metric(sources, renderer, monkeypatch):
    right = ask(sources, renderer, monkeypatch, 1)
    assert {k: v for k, v in right.items() if k.startswith("eval_score/")} == {f"eval_score/{m}": 1.0 for m in SOURCES}
    wrong = ask(sources, renderer, monkeypatch, 2)
    assert {k: v for k, v in wrong.items() if k.startswith("eval_score/")} == {f"eval_score/{m}": 0.0 for m in SOURCES}
    assert all(v == 0 for k, v in right.items() if k.startswith("eval_unparsed/"))


def test_the_prompts_ask_as_the_benchmarks_ask(sources, renderer):
    prompt = scored_prompts(sources["multiple_choice"], renderer)[0][0]
    assert prompt.text.endswith(
        "Shape?\nA. circle\nB. square<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert prompt.references == ("B",) and prompt.options == ("circle", "square")
    vqa = scored_prompts(sources["vqa_accuracy"], renderer)[0][0]
    assert len(vqa.references) == 10 and vqa.sample.num_images == 1


def test_thinking_replies_are_scored_after_the_think_block_and_a_cut_one_is_unparsed(sources, renderer, monkeypatch):
    thinking = {k: ScoredSource(k, s.source, s.metric, thinking=True, max_new_tokens=8) for k, s in sources.items()}
    prompt = scored_prompts(thinking["exact_match"], renderer)[0][0]
    assert prompt.text.endswith("<|im_start|>assistant\n<think>\n")  # the prompt opens the think block
    right = ask(thinking, renderer, monkeypatch, 1, thinking="Let me look.\n</think>\n\n")
    assert all(right[f"eval_score/{m}"] == 1.0 for m in SOURCES)
    cut = ask(thinking, renderer, monkeypatch, 1, thinking="Let me look, and look again, and ")
    assert all(cut[f"eval_score/{m}"] == 0.0 and cut[f"eval_unparsed/{m}"] == 1 for m in SOURCES)
