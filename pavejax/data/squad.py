"""SQuAD v1.1 question answering: the development set, the official metrics and the prompt.

Source: the optional ``squad`` asset (``pavejax assets --with squad``), the SQuAD v1.1
development set as shipped in BIG-bench's ``squad_shifts`` task: 48 Wikipedia articles,
10,565 questions, each with one or more gold answer spans written by crowd workers. Licence
CC BY-SA 4.0 (Rajpurkar, Zhang, Lopyrev and Liang, "SQuAD: 100,000+ Questions for Machine
Comprehension of Text", EMNLP 2016); a stored subset must carry that attribution.

Scoring follows the official v1.1 evaluation script: answers are compared after
:func:`normalize_answer`; a prediction's score is the maximum over the gold answers of the
token-level F1 (:func:`squad_f1`) or of exact match (:func:`squad_em`). The prompt is the one of
the MeZO / PACZero code (:func:`squad_prompt`), and a generation is read up to its first line
break (:func:`answer_text`).
"""

from __future__ import annotations

import collections
import functools
import json
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pavejax.assets import require

SQUAD_FILENAME = "squaddev_v1.1.json"
SQUAD_SOURCE = "bigbench==1.0.0 sdist, bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json"
SQUAD_LICENSE = "CC BY-SA 4.0 (Rajpurkar et al., 2016)"

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


@dataclass(frozen=True)
class SquadExample:
    """One question: ``id`` (the dataset's question id), the article ``title`` (underscores
    turned into spaces), the paragraph ``context``, the ``question`` and its gold ``answers``
    (at least one; repeats kept as in the file, they do not change a max-over-answers score)."""

    id: str
    title: str
    context: str
    question: str
    answers: tuple[str, ...]


def _parse(raw: dict, where: str) -> tuple[SquadExample, ...]:
    try:
        articles = raw["data"]
        out = []
        for article in articles:
            title = article["title"].replace("_", " ")
            for paragraph in article["paragraphs"]:
                for qa in paragraph["qas"]:
                    answers = tuple(a["text"] for a in qa["answers"])
                    if not answers:
                        raise ValueError(f"question {qa['id']} has no gold answer")
                    out.append(SquadExample(qa["id"], title, paragraph["context"],
                                            qa["question"], answers))
    except (KeyError, TypeError) as err:
        raise ValueError(f"{where} is not SQuAD v1.1 JSON (data / paragraphs / qas / answers): "
                         f"missing or malformed {err}") from None
    return tuple(out)


@functools.cache
def _load_all(path: Path) -> tuple[SquadExample, ...]:
    with open(path, encoding="utf-8") as f:
        return _parse(json.load(f), str(path))


def load_squad(*, max_examples: int | None = None, seed: int = 0,
               path: str | Path | None = None) -> list[SquadExample]:
    """SQuAD v1.1 development questions, one :class:`SquadExample` per question.

    ``path`` defaults to the installed ``squad`` asset (raises :class:`AssetMissingError`
    naming ``pavejax assets --with squad`` when absent). Without ``max_examples`` every question
    is returned in file order; with it, the first ``max_examples`` of a
    ``numpy.random.default_rng(seed)`` permutation, so a smaller draw is a prefix of a larger
    one with the same seed (cut consecutive slices of one draw for disjoint pool/dev/test sets).
    Questions of one paragraph share its context. Parsed once per process and file.
    """
    file = Path(path) if path is not None else require("squad") / SQUAD_FILENAME
    examples = _load_all(file.resolve())
    if max_examples is None:
        return list(examples)
    if isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 0:
        raise ValueError(f"max_examples must be a non-negative int or None, got {max_examples!r}")
    if max_examples > len(examples):
        raise ValueError(f"max_examples={max_examples} exceeds the {len(examples)} questions in "
                         f"{file.name}; pass max_examples=None for all of them")
    order = np.random.default_rng(seed).permutation(len(examples))[:max_examples]
    return [examples[i] for i in order.tolist()]


# --- official SQuAD v1.1 evaluation -----------------------------------------------------------


def normalize_answer(text: str) -> str:
    """The official SQuAD normalisation: lower-case, drop ASCII punctuation, drop the articles
    a/an/the (whole words), collapse whitespace to single spaces (no leading/trailing)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1_score(prediction: str, ground_truth: str) -> float:
    """Token-level F1 of one prediction against one gold answer, on normalised whitespace
    tokens: with ``c`` tokens in common (multiset intersection), precision ``c / |pred|``,
    recall ``c / |gold|``, F1 their harmonic mean; 0.0 when nothing is shared (including an
    empty prediction or an answer that normalises to nothing, as in the v1.1 script)."""
    pred = normalize_answer(prediction).split()
    gold = normalize_answer(ground_truth).split()
    common = sum((collections.Counter(pred) & collections.Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match_score(prediction: str, ground_truth: str) -> float:
    """1.0 when the two normalise to the same string, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def _max_over(metric, prediction: str, answers: Sequence[str]) -> float:
    if isinstance(answers, str) or len(answers) == 0:
        raise ValueError("answers must be a non-empty sequence of gold answer strings, got "
                         f"{answers!r}")
    return max(metric(prediction, a) for a in answers)


def squad_f1(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD F1 of a prediction: the best :func:`f1_score` over the gold ``answers``, in [0, 1]."""
    return _max_over(f1_score, prediction, answers)


def squad_em(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD exact match: 1.0 if the prediction matches any gold answer after normalisation."""
    return _max_over(exact_match_score, prediction, answers)


# --- prompting --------------------------------------------------------------------------------


def squad_prompt(example: SquadExample) -> str:
    """The MeZO / PACZero prompt, ``"Title: …\\nContext: …\\nQuestion: …\\nAnswer:"``, with the
    question stripped of surrounding whitespace and no space after ``Answer:`` (the model
    writes it)."""
    return (f"Title: {example.title}\nContext: {example.context}\n"
            f"Question: {example.question.strip()}\nAnswer:")


def answer_text(generated: str) -> str:
    """The answer in a generation: the text before its first line break, stripped (the
    generation stops at ``"\\n"`` as in MeZO; anything after it is not part of the answer)."""
    return generated.split("\n", 1)[0].strip()
