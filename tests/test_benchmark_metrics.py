"""The benchmark metrics against hand-worked cases from the benchmarks' own definitions (``trainer.benchmark_metrics``).

Each case is worked from the rule its docstring cites: the ANLS threshold at and around 0.5, ChartQA's 5% edge and its
reading of "45%" and "1,234", EvalAI's answer normalization and the leave-one-annotator-out VQA average, the reply
forms a multiple-choice scorer reads as a letter, and the think block cut from a thinking reply.
"""

from __future__ import annotations

import math

import pytest

from vlm_sft.data.options import format_options
from vlm_sft.trainer.benchmark_metrics import (
    INSTRUCTIONS,
    METRICS,
    Score,
    anls,
    bootstrap_interval,
    exact_match,
    multiple_choice,
    normalize_vqa,
    relaxed_accuracy,
    score_reply,
    vqa_accuracy,
)

OPTIONS = ("Paris", "London", "Rome", "Berlin")

# ---------------------------------------------------------------------------------------------------- exact match


@pytest.mark.parametrize("prediction", ["Paris", "paris", "  PARIS \n", "Paris.", "paris ."])
def test_exact_match_ignores_case_whitespace_and_a_closing_period(prediction):
    assert exact_match(prediction, ["Paris"]) == 1.0


def test_exact_match_is_exact_otherwise():
    assert exact_match("New  York", ["new york"]) == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0
    assert exact_match("Pari", ["Paris", "Rome"]) == 0.0
    assert exact_match("rome", ["Paris", "Rome"]) == 1.0


# ----------------------------------------------------------------------------------------------------------- ANLS


def test_anls_is_one_minus_the_normalized_distance():
    assert anls("Paris", ["paris"]) == 1.0
    assert anls("  New   York ", ["new york"]) == 1.0  # whitespace collapsed in the distance
    assert anls("abcdefghiX", ["abcdefghij"]) == pytest.approx(0.9)  # 1 edit / 10 characters


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [
        ("abcdeXXXXX", 0.5),  # distance exactly 0.5: the official script keeps it (similarity < 0.5 -> 0)
        ("abcdefXXXX", 0.6),  # just above
        ("abcdXXXXXX", 0.0),  # similarity 0.4, below the threshold
    ],
)
def test_anls_threshold_edges(prediction, expected):
    assert anls(prediction, ["abcdefghij"]) == pytest.approx(expected)


def test_anls_takes_the_closest_reference_and_the_threshold_argument():
    assert anls("abcdefXXXX", ["zzzz", "abcdefghij"]) == pytest.approx(0.6)
    assert anls("abcdefXXXX", ["abcdefghij"], threshold=0.7) == 0.0


def test_anls_divides_by_the_longer_string_as_given():
    """The official script measures the raw strings' lengths: 1 edit over the 8 characters of "  abcx  ", not 4."""
    assert anls("  abcx  ", ["abcd"]) == pytest.approx(1 - 1 / 8)


# ----------------------------------------------------------------------------------------------- relaxed accuracy


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [("100", 1.0), ("104.9", 1.0), ("105", 1.0), ("105.1", 0.0), ("95", 1.0), ("94.9", 0.0), ("-100", 0.0)],
)
def test_relaxed_accuracy_tolerates_five_percent(prediction, expected):
    assert relaxed_accuracy(prediction, ["100"]) == expected


def test_relaxed_accuracy_reads_percent_and_thousands_as_the_official_scorer():
    assert relaxed_accuracy("45%", ["0.45"]) == 1.0  # "45%" is the number 0.45
    assert relaxed_accuracy("45%", ["45"]) == 0.0
    assert relaxed_accuracy("45%", ["46%"]) == 1.0  # 0.45 vs 0.46: within 5%
    assert relaxed_accuracy("1,234", ["1234"]) == 0.0  # a separator makes it text
    assert relaxed_accuracy("1,234", ["1,234"]) == 1.0


def test_relaxed_accuracy_falls_back_to_case_insensitive_text():
    assert relaxed_accuracy("Yes", ["yes"]) == 1.0
    assert relaxed_accuracy("Yes", ["No"]) == 0.0
    assert relaxed_accuracy("0", ["0"]) == 1.0  # a zero target is compared as text
    assert relaxed_accuracy("0.0", ["0"]) == 0.0
    assert relaxed_accuracy("12", ["ten", "12.3"]) == 1.0  # any reference


# --------------------------------------------------------------------------------------------------- VQA accuracy


@pytest.mark.parametrize(
    ("answer", "normalized"),
    [
        ("Two", "2"),
        ("none", "0"),
        ("ten dogs", "10 dogs"),
        ("A dog", "dog"),
        ("the Red car", "red car"),
        ("yes!", "yes"),
        ("Yes.", "yes"),
        ("red-car", "red car"),
        ("red - car", "red car"),
        ("2.5", "2.5"),
        ("1,000", "1000"),
        ("dont", "don't"),
        ("yall'll", "y'all'll"),
        ("man's hat?", "man 's hat"),
    ],
)
def test_vqa_normalization(answer, normalized):
    assert normalize_vqa(answer) == normalized


@pytest.mark.parametrize(("matching", "expected"), [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)])
def test_vqa_accuracy_averages_over_leaving_one_annotator_out(matching, expected):
    references = ["two"] * matching + ["three"] * (10 - matching)
    assert vqa_accuracy("2", references) == pytest.approx(expected)


def test_vqa_accuracy_with_fewer_references_applies_the_same_formula():
    assert vqa_accuracy("cat", ["cat"]) == 0.0  # leaving the only annotator out leaves no match
    assert vqa_accuracy("cat", ["cat", "cat", "cat"]) == pytest.approx(2 / 3)
    assert vqa_accuracy("The cat.", ["cat"] * 4) == 1.0


# ------------------------------------------------------------------------------------------------ multiple choice


@pytest.mark.parametrize(
    "reply",
    [
        "B", "(B)", "B.", "B)", "**B**", "b", "(b)", "\\boxed{B}",
        "The answer is B.", "Answer: B", "the answer is b.", "The correct option is (B).", "B. London",
        "B is correct", "London", "london.", "I think it is London.",
    ],
)  # fmt: skip
def test_multiple_choice_reads_the_letter(reply):
    assert multiple_choice(reply, OPTIONS, ["B"]) == Score(1.0, True, "B")


@pytest.mark.parametrize(
    "reply",
    ["", "I do not know", "The answer is a bird", "A cat sits on the mat", "E", "Answer: E", "B or C", "A and B",
     "The answer is B or C.", "Paris or London"],
)  # fmt: skip
def test_multiple_choice_without_one_letter_is_unparsed(reply):
    assert multiple_choice(reply, OPTIONS, ["B"]) == Score(0.0, False, "")


def test_multiple_choice_wrong_letter_is_parsed_and_scores_zero():
    assert multiple_choice("The answer is C.", OPTIONS, ["B"]) == Score(0.0, True, "C")
    assert multiple_choice("c", OPTIONS, ["B", "C"]) == Score(1.0, True, "C")  # several correct letters


def test_multiple_choice_declaration_beats_letters_in_the_reasoning():
    assert multiple_choice("A: Paris. B: London. Answer: B", OPTIONS, ["B"]) == Score(1.0, True, "B")
    assert multiple_choice("The answer is B, because C is wrong.", OPTIONS, ["B"]).answer == "B"


def test_multiple_choice_rejects_bad_data():
    with pytest.raises(ValueError, match="not all among the options' letters ABCD"):
        multiple_choice("B", OPTIONS, ["E"])
    with pytest.raises(ValueError, match="1 to 26 option texts"):
        multiple_choice("B", (), ["B"])


def test_format_options_and_instructions():
    assert format_options("Capital of the UK?", OPTIONS[:3]) == "Capital of the UK?\nA. Paris\nB. London\nC. Rome"
    assert INSTRUCTIONS["multiple_choice"] == "Answer with the option's letter from the given choices directly."
    assert INSTRUCTIONS["anls"] == INSTRUCTIONS["vqa_accuracy"] == "Answer the question using a single word or phrase."


# ----------------------------------------------------------------------------------------------------- score_reply

RIGHT_AND_WRONG = {
    "exact_match": (["Paris"], {}, "Paris", "Rome"),
    "anls": (["Paris"], {}, "Paris", "Rome"),
    "relaxed_accuracy": (["42"], {}, "42", "50"),
    "vqa_accuracy": (["paris"] * 10, {}, "paris", "rome"),
    "multiple_choice": (["B"], {"options": OPTIONS}, "B", "C"),
}


@pytest.mark.parametrize("metric", METRICS)
def test_every_metric_scores_its_references_one_and_a_wrong_reply_zero(metric):
    references, kwargs, right, wrong = RIGHT_AND_WRONG[metric]
    assert score_reply(metric, right, references, **kwargs) == Score(1.0, True, right)
    assert score_reply(metric, wrong, references, **kwargs).value == 0.0


@pytest.mark.parametrize("metric", METRICS)
def test_thinking_replies_are_scored_after_the_think_block(metric):
    references, kwargs, right, _ = RIGHT_AND_WRONG[metric]
    thought = f"<think>\nIt could be {right}... or not.\n</think>\n\n{right}"
    assert score_reply(metric, thought, references, thinking=True, **kwargs) == Score(1.0, True, right)
    assert score_reply(metric, f"reasoning</think>{right}", references, thinking=True, **kwargs).value == 1.0
    cut_off = f"<think>\nIt could be {right}, but"
    assert score_reply(metric, cut_off, references, thinking=True, **kwargs) == Score(0.0, False, "")


def test_without_thinking_the_think_block_is_part_of_the_reply():
    assert score_reply("exact_match", "<think>x</think>Paris", ["Paris"]).value == 0.0


def test_score_reply_rejects_bad_calls():
    with pytest.raises(ValueError, match="exact_match, anls, relaxed_accuracy, vqa_accuracy, multiple_choice"):
        score_reply("bleu", "Paris", ["Paris"])
    with pytest.raises(ValueError, match="wrap it in a list"):
        score_reply("anls", "Paris", "Paris")
    with pytest.raises(ValueError, match="no references"):
        score_reply("exact_match", "Paris", [])
    with pytest.raises(ValueError, match="multiple_choice metric only"):
        score_reply("exact_match", "Paris", ["Paris"], options=OPTIONS)
    with pytest.raises(ValueError, match="not all among"):
        score_reply("multiple_choice", "<think>cut", ["Z"], options=OPTIONS, thinking=True)


# ---------------------------------------------------------------------------------------------------- uncertainty


def test_bootstrap_interval_holds_the_mean_and_is_deterministic():
    values = [1.0] * 30 + [0.0] * 70 + [0.5] * 20
    mean = sum(values) / len(values)
    low, high = bootstrap_interval(values)
    assert low < mean < high and high - low < 0.25
    assert bootstrap_interval(values) == (low, high)
    assert bootstrap_interval(values, seed=1) != (low, high)
    narrow = bootstrap_interval(values, level=0.5)
    assert low < narrow[0] < narrow[1] < high


def test_bootstrap_interval_edges():
    assert all(math.isnan(x) for x in bootstrap_interval([]))
    assert bootstrap_interval([0.7] * 5) == pytest.approx((0.7, 0.7))
    with pytest.raises(ValueError, match="level"):
        bootstrap_interval([1.0], level=1.5)
