"""Benchmark metrics, defined as the benchmarks define them: pure functions from one reply and its references to a score.

``score_reply(metric, reply, references)`` is the one entry point: it cuts a thinking reply to its answer, strips
it, and applies one of ``METRICS``; each metric is also a function of its own. The definitions, each read from the
official scorer or from lmms-eval's task code and written here anew (the docstrings name the source):

- ``exact_match``: ours (no benchmark), with a stated normalization;
- ``anls``: DocVQA / InfographicVQA, the RRC scoring script that lmms-eval copies;
- ``relaxed_accuracy``: ChartQA, pix2struct's ``relaxed_correctness`` that lmms-eval copies;
- ``vqa_accuracy``: VQAv2 / TextVQA, EvalAI's answer processing and the leave-one-annotator-out average;
- ``multiple_choice``: AI2D / MMMU / MMBench / ScienceQA, the letter read from the reply with the patterns their
  scorers accept (VLMEvalKit's ``can_infer``, MMMU's ``parse_multi_choice_response``), or the option's text.

A reply that cannot be read as an answer (no letter, several letters, a thinking reply cut off inside its think
block) scores 0 with ``parsed=False``, so a run counts its unparseable replies instead of hiding them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from vlm_sft.config import METRICS
from vlm_sft.data.options import option_letters

SHORT_ANSWER = "Answer the question using a single word or phrase."
"""lmms-eval's default ``post_prompt`` for DocVQA, InfoVQA, ChartQA, TextVQA and VQAv2 (their task YAMLs)."""
LETTER_ANSWER = "Answer with the option's letter from the given choices directly."
"""lmms-eval's default ``post_prompt`` for AI2D and ScienceQA and ``multiple_choice_prompt`` for MMMU."""

INSTRUCTIONS: dict[str, str] = {
    "anls": SHORT_ANSWER,
    "relaxed_accuracy": SHORT_ANSWER,
    "vqa_accuracy": SHORT_ANSWER,
    "multiple_choice": LETTER_ANSWER,
}
"""The benchmarks' standard instruction suffix per metric. lmms-eval appends it after a newline (``"\\n"``; MMMU
after a blank line, ``"\\n\\n"``). ``exact_match`` has none: no benchmark defines it."""

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Score:
    """One reply's score."""

    value: float
    """In [0, 1]."""
    parsed: bool
    """False when the reply could not be read as an answer: a multiple-choice reply with no letter or option text
    (or several), a thinking reply cut off inside its think block."""
    answer: str
    """What was scored: the reply's answer text, whitespace stripped, or the chosen letter ("" when not parsed)."""


def score_reply(
    metric: str, reply: str, references: Sequence[str], *, options: Sequence[str] = (), thinking: bool = False
) -> Score:
    """Score one generated ``reply`` with ``metric`` against its ``references``.

    With ``thinking`` the answer is the text after the last ``</think>``; a reply with ``<think>`` and no ``</think>``
    was cut off inside its reasoning and scores 0, unparsed (a reply with neither tag answered without one; where the
    prompt itself opens the block, pass the reply with ``<think>`` in front). For ``multiple_choice`` the
    ``references`` are the correct letter(s) (``["B"]``) and ``options`` the option texts in order A, B, C, ...
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}: choose one of {', '.join(METRICS)}")
    _check_references(references)
    if metric == "multiple_choice":
        _correct_letters(references, option_letters(options))
    elif options:
        raise ValueError(f"options are for the multiple_choice metric only, got {len(options)} with {metric!r}")
    if thinking:
        if THINK_CLOSE in reply:
            reply = reply.rsplit(THINK_CLOSE, 1)[1]
        elif THINK_OPEN in reply:
            return Score(0.0, False, "")
    answer = reply.strip()
    if metric == "multiple_choice":
        return multiple_choice(answer, options, references)
    return Score(_TEXT_METRICS[metric](answer, references), True, answer)


def _check_references(references: Sequence[str]) -> None:
    """A bare string would be read as one reference per character; an empty list leaves nothing to score against."""
    if isinstance(references, str):
        raise ValueError(f"references must be a list of strings, got the string {references!r}: wrap it in a list")
    if len(references) == 0:
        raise ValueError("no references to score against: give at least one reference answer")


# ---------------------------------------------------------------------------------------------------- exact match


def normalize_exact(text: str) -> str:
    """Lowercased, whitespace runs collapsed to one space and stripped, one trailing period removed."""
    text = " ".join(text.lower().split())
    return text[:-1].rstrip() if text.endswith(".") else text


def exact_match(prediction: str, references: Sequence[str]) -> float:
    """1.0 when the normalized prediction equals any normalized reference (``normalize_exact``: case, whitespace and
    a closing period do not count), else 0.0. Ours: no benchmark defines it; the normalization is the least that
    keeps "Paris." and "paris" equal."""
    _check_references(references)
    return float(normalize_exact(prediction) in {normalize_exact(r) for r in references})


# ----------------------------------------------------------------------------------------------------------- ANLS


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each 1) between ``a`` and ``b``: two-row dynamic
    programming, the shorter string along the row."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def anls(prediction: str, references: Sequence[str], threshold: float = 0.5) -> float:
    """Average Normalized Levenshtein Similarity of one question (DocVQA, InfographicVQA).

    As the official RRC scoring script computes it (rrc.cvc.uab.es, DocVQA / InfographicVQA downloads; copied as
    ``anls`` in lmms-eval's ``lmms_eval/api/metrics.py``, which its docvqa and infovqa tasks use): both strings
    lowercased with whitespace runs collapsed and stripped; distance = edit distance / the longer of the two strings
    *as given* (the script measures the raw strings, not the normalized ones); similarity = 1 - the smallest distance
    over the references, set to 0 when it is *below* ``threshold``. So a distance of exactly 0.5 keeps 0.5 (the paper,
    Biten et al. 2019 Eq. 1, zeroes it; the script, which the leaderboard runs, does not).
    """
    _check_references(references)
    predicted = " ".join(prediction.lower().split())
    distances = []
    for reference in references:
        longest = max(len(reference.upper()), len(prediction.upper()))
        expected = " ".join(reference.lower().split())
        distances.append(levenshtein(expected, predicted) / longest if longest else 0.0)
    similarity = 1.0 - min(distances)
    return similarity if similarity >= threshold else 0.0


# ----------------------------------------------------------------------------------------------- relaxed accuracy


def _chartqa_number(text: str) -> float | None:
    """The number ``text`` spells as ChartQA's scorer reads it: Python's ``float`` of the text, a trailing ``%``
    divided by 100 ("45%" is 0.45); anything else ("1,234", "12 kg") is not a number and is compared as text. Non-finite
    values ("nan", "inf") count as text too, where the official code would compare them numerically and fail."""
    try:
        value = float(text.rstrip("%")) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def relaxed_correct(prediction: str, target: str, tolerance: float = 0.05) -> bool:
    """ChartQA's relaxed correctness of one prediction against one target: both numbers and the target non-zero ->
    ``|p - t| / |t| <= tolerance``; otherwise (text, or a target of 0) case-insensitive string equality."""
    predicted, expected = _chartqa_number(prediction), _chartqa_number(target)
    if predicted is not None and expected is not None and expected != 0:
        return abs(predicted - expected) / abs(expected) <= tolerance
    return prediction.lower() == target.lower()


def relaxed_accuracy(prediction: str, references: Sequence[str], tolerance: float = 0.05) -> float:
    """ChartQA relaxed accuracy: 1.0 when ``relaxed_correct`` holds for any reference, else 0.0.

    The definition: Masry et al. 2022 (arXiv 2203.10244, end of section 5.1: "within 5% of the gold answer ...
    non-numeric answers need an exact match"); the code: pix2struct ``metrics.py`` ``relaxed_correctness`` (the max
    over a question's targets in ``aggregate_metrics``), copied in lmms-eval ``tasks/chartqa/utils.py``. Percent and
    thousands separators are as there: "45%" is the number 0.45 (so it matches "0.45", not "45"), "1,234" is text
    (so it matches "1,234" only). Surrounding whitespace is stripped first (``float`` ignores it anyway).
    """
    _check_references(references)
    predicted = prediction.strip()
    return float(any(relaxed_correct(predicted, reference.strip(), tolerance) for reference in references))


# --------------------------------------------------------------------------------------------------- VQA accuracy

_VQA_PUNCTUATION = ';/[]"{}()=+\\_-><@`!'
"""EvalAI's punctuation list, less "," and "?" which its tokenizing step has already deleted."""
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_VQA_NUMBERS = {"none": "0", **{word: str(i) for i, word in enumerate(_NUMBER_WORDS)}}
_VQA_ARTICLES = frozenset(("a", "an", "the"))
_VQA_CONTRACTED = """ain't aren't can't could've couldn't couldn't've didn't doesn't don't hadn't hadn't've hasn't
haven't he'd he'd've he's how'd how'll how's isn't it'd it'd've it'll ma'am mightn't mightn't've might've mustn't
must've needn't not've o'clock oughtn't 'ow's'at shan't she'd've should've shouldn't shouldn't've somebody'd've
somebody'll somebody's someone'd someone'd've someone'll someone's something'd something'd've something'll that's
there'd there'd've there're there's they'd they'd've they'll they're they've 'twas wasn't we'd've we've weren't
what'll what're what's what've when's where'd where's where've who'd who'd've who'll who's who've why'll why're
why's won't would've wouldn't wouldn't've y'all y'all'll y'all'd've you'd you'd've you'll you're you've""".split()  # noqa: SIM905 (95 words read better as text than as a literal)


def _contraction_spellings() -> dict[str, str]:
    """EvalAI's contraction table: each contraction keyed by every spelling that drops one of its apostrophes
    ("dont" -> "don't", "hed've" and "he'dve" -> "he'd've"). That rule gives the whole table but for one entry the
    table has backwards, kept as it is: "somebody'd" -> "somebodyd"."""
    table = {}
    for word in _VQA_CONTRACTED:
        for i, char in enumerate(word):
            if char == "'":
                table[word[:i] + word[i + 1 :]] = word
    table["somebody'd"] = "somebodyd"
    return table


_VQA_CONTRACTIONS = _contraction_spellings()


def normalize_vqa(answer: str) -> str:
    """An answer as EvalAI's VQA processor leaves it (mmf ``EvalAIAnswerProcessor``; lmms-eval
    ``tasks/_task_utils/vqa_eval_metric.py``), in its order:

    1. lowercase; delete "," and "?"; "'s" -> " 's"; newlines and tabs -> spaces; strip;
    2. each mark of ``_VQA_PUNCTUATION``: deleted everywhere if it touches a space anywhere in the text, else every
       occurrence becomes a space ("red-car" -> "red car", "red - car" -> "red car");
    3. periods not followed by a digit deleted ("2.5" stays; the official call caps this at 32, which no answer
       reaches);
    4. per word: number words "none", "zero" ... "ten" -> digits, articles "a", "an", "the" dropped, contractions
       written with their apostrophes ("dont" -> "don't"); words joined by single spaces.
    """
    text = answer.lower().replace(",", "").replace("?", "").replace("'s", " 's")
    text = text.replace("\n", " ").replace("\t", " ").strip()
    spaced = text
    for mark in _VQA_PUNCTUATION:
        touches_space = f"{mark} " in spaced or f" {mark}" in spaced
        text = text.replace(mark, "" if touches_space else " ")
    text = re.sub(r"\.(?!\d)", "", text)
    words = (_VQA_NUMBERS.get(word, word) for word in text.split())
    return " ".join(_VQA_CONTRACTIONS.get(word, word) for word in words if word not in _VQA_ARTICLES)


def vqa_accuracy(prediction: str, references: Sequence[str]) -> float:
    """VQA accuracy (VQAv2, TextVQA, VizWiz): min(1, matching annotators / 3), averaged over the subsets that leave
    one annotator out.

    The prediction and every reference go through ``normalize_vqa``; with n references, leaving out reference i
    leaves the matches among the other n - 1, so 1, 2, 3, 4+ matches out of 10 give 0.3, 0.6, 0.9, 1.0. Source: the
    VQA evaluation tool ``vqaEval.py`` (GT-Vision-Lab/VQA) and lmms-eval ``tasks/textvqa/utils.py``
    ``textvqa_process_results``, which normalizes the references as here. Fewer than 10 references get the same
    formula over those given: fewer than 4 cannot reach 1.0, and a single reference always scores 0.
    """
    _check_references(references)
    predicted = normalize_vqa(prediction)
    matches = [normalize_vqa(reference) == predicted for reference in references]
    total = sum(matches)
    return sum(min(1.0, (total - left_out) / 3) for left_out in matches) / len(matches)


_TEXT_METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "exact_match": exact_match,
    "anls": anls,
    "relaxed_accuracy": relaxed_accuracy,
    "vqa_accuracy": vqa_accuracy,
}


# ------------------------------------------------------------------------------------------------ multiple choice


def _correct_letters(answer_letters: Sequence[str], letters: str) -> frozenset[str]:
    """The correct letters, upper-cased, each checked to be one of the options' (an index given for a letter, or a
    letter past the last option, is a data error)."""
    _check_references(answer_letters)
    correct = frozenset(a.strip().upper() for a in answer_letters)
    if not correct <= set(letters):
        raise ValueError(f"answer letters {sorted(correct)} are not all among the options' letters {letters}")
    return correct


_BOXED = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")
_EMPHASIS = re.compile(r"[*`]")
_WHOLE_LETTER = re.compile(r"[(\[]?([A-Za-z])[)\]]?[.,:;!?]?")
_DECLARATION = re.compile(
    r"\b(?:answer|option|choice)\b\s*(?:is\b\s*:?|[:：])\s*(?:option\s+)?[(\[]?([A-Za-z])[)\]]?(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_ALTERNATIVE = re.compile(r"\s*(?:,|/|&|\bor\b|\band\b)\s*[(\[]?([A-Z])(?![A-Za-z0-9])")
_LABEL = re.compile(r"(?:\(([A-Z])\)|\[([A-Z])\]|([A-Z])\)?)[.,:;!?]?")
_ENGLISH_LETTERS = frozenset("AI")
"""Bare "A" and "I" are words too: in a reply of more than 3 words they are not read as letters (VLMEvalKit's rule
for "A", the article)."""


def _declared(text: str) -> set[str]:
    """Letters the reply declares: "The answer is B", "Answer: (B)", "the correct option is C". A lowercase letter
    only with nothing but punctuation after it ("the answer is b." but not "the answer is a bird"); a letter followed
    by an alternative ("B or C", "B, C") declares both."""
    found = set()
    for match in _DECLARATION.finditer(text):
        letter, rest = match[1], text[match.end() :]
        if letter.islower() and not re.match(r"\s*(?:[.,;:!?]|$)", rest):
            continue
        found.add(letter.upper())
        alternative = _ALTERNATIVE.match(rest)
        if alternative:
            found.add(alternative[1])
    return found


def _labels(text: str) -> set[str]:
    """Upper-case letters standing as words: "B", "B.", "B)", "(B)", "[B]", "B:" (VLMEvalKit's ``can_infer_option``
    forms)."""
    words = text.split()
    found = set()
    for word in words:
        match = _LABEL.fullmatch(word)
        if match and not (word in _ENGLISH_LETTERS and len(words) > 3):
            found.add(next(group for group in match.groups() if group))
    return found


def _contains_option(text: str, option: str) -> bool:
    """The normalized option text occurs in the normalized reply as whole words."""
    needle = normalize_exact(option)
    return bool(needle) and re.search(rf"(?<!\w){re.escape(needle)}(?!\w)", normalize_exact(text)) is not None


def read_choice(reply: str, options: Sequence[str]) -> str | None:
    """The option letter ``reply`` chooses, or None when it names none or several. Tried in order, the first that
    finds anything decides:

    1. the whole reply is one letter, bare or decorated, either case: "B", "(b)", "B.", "**B**", "\\boxed{B}";
    2. the whole reply is one option's text (case, whitespace and a closing period aside);
    3. declared letters (``_declared``): exactly one, else None;
    4. letters standing as words (``_labels``): exactly one, else None ("B or C");
    5. the reply contains exactly one option's text as whole words.

    The patterns are those MMBench's ``can_infer`` (VLMEvalKit, in lmms-eval ``tasks/mmbench/mmbench_evals.py``),
    MMMU's ``parse_multi_choice_response`` and ScienceQA's "B. ..." reading accept; where they guess (MMMU: the last
    of several letters, or a random one when none) or ask a judge model (MMBench), this returns None.
    """
    letters = option_letters(options)
    text = _EMPHASIS.sub("", _BOXED.sub(r"\1", reply)).strip()
    whole = _WHOLE_LETTER.fullmatch(text)
    if whole and whole[1].upper() in letters:
        return whole[1].upper()
    pairs = list(zip(letters, options, strict=True))
    exact = [letter for letter, option in pairs if normalize_exact(option) == normalize_exact(text)]
    if len(exact) == 1:
        return exact[0]
    for found in (_declared(text), _labels(text) & set(letters)):
        if found:
            return next(iter(found)) if len(found) == 1 and found <= set(letters) else None
    contained = [letter for letter, option in pairs if _contains_option(text, option)]
    return contained[0] if len(contained) == 1 else None


def multiple_choice(reply: str, options: Sequence[str], answer_letters: Sequence[str]) -> Score:
    """Multiple-choice accuracy (AI2D, MMMU, MMBench, ScienceQA): 1.0 when the letter ``read_choice`` reads from the
    reply is one of ``answer_letters``; a reply with no readable letter, or several, scores 0 with ``parsed=False``."""
    correct = _correct_letters(answer_letters, option_letters(options))
    letter = read_choice(reply, options)
    if letter is None:
        return Score(0.0, False, "")
    return Score(float(letter in correct), True, letter)


# ---------------------------------------------------------------------------------------------------- uncertainty


def bootstrap_interval(
    values: Sequence[float], *, resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values``: the ``(1 - level) / 2`` and ``(1 + level) / 2``
    quantiles of the means of ``resamples`` resamples with replacement, drawn from a generator seeded with ``seed``
    (so the same values give the same interval). ``(nan, nan)`` for no values."""
    if resamples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"bootstrap needs resamples >= 1 and 0 < level < 1, got resamples={resamples}, level={level}")
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    chunk = max(1, (1 << 22) // data.size)  # at most ~4M indices in memory at once
    means = []
    for start in range(0, resamples, chunk):
        picks = rng.integers(0, data.size, size=(min(chunk, resamples - start), data.size))
        means.append(data[picks].mean(axis=1))
    low, high = np.quantile(np.concatenate(means), [(1.0 - level) / 2, (1.0 + level) / 2])
    return float(low), float(high)
