"""Tests of pavejax.data.squad: the official SQuAD v1.1 metrics, the prompt, and loading."""

import json

import pytest

from pavejax.assets import AssetMissingError, require
from pavejax.data.squad import (
    SquadExample,
    answer_text,
    exact_match_score,
    f1_score,
    load_squad,
    normalize_answer,
    squad_em,
    squad_f1,
    squad_prompt,
)

# --- metric, hand-worked ----------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("The Denver Broncos", "denver broncos"),
    ("  an  apple,\ta pear. ", "apple pear"),
    ("Theory of the mind!", "theory of mind"),      # "the" only as a whole word
    ("U.S.-based", "usbased"),
    ("A", ""),
    ("", ""),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_hand_worked():
    assert exact_match_score("the Denver Broncos", "Denver Broncos") == 1.0
    assert exact_match_score("Denver Broncos.", "denver  broncos") == 1.0
    assert exact_match_score("Broncos", "Denver Broncos") == 0.0


def test_f1_hand_worked():
    # pred {broncos, won}, gold {denver, broncos}: 1 shared; P = R = 1/2; F1 = 2PR/(P+R) = 0.5.
    assert f1_score("Broncos won", "Denver Broncos") == pytest.approx(0.5)
    # Punctuation is deleted, not split on: "24-10" is one token "2410". pred [denver, broncos,
    # 2410], gold [denver, broncos]: P = 2/3, R = 1, F1 = (4/3) / (5/3) = 0.8.
    assert f1_score("Denver Broncos 24-10", "Denver Broncos") == pytest.approx(0.8)
    # pred [denver, broncos, 24, 10]: P = 1/2, R = 1, F1 = 2/3.
    assert f1_score("Denver Broncos 24 10", "Denver Broncos") == pytest.approx(2 / 3)
    # Tokens are a multiset: pred "the the cat" -> [cat], gold [cat, cat]: one shared;
    # P = 1, R = 1/2, F1 = 2/3.
    assert f1_score("the the cat", "cat cat") == pytest.approx(2 / 3)
    assert f1_score("", "Denver Broncos") == 0.0
    assert f1_score("The", "the") == 0.0           # both normalise to nothing: 0 in v1.1
    assert f1_score("Santa Clara", "Levi's Stadium") == 0.0


def test_max_over_gold_answers():
    gold = ("Denver Broncos", "Broncos", "the Broncos team")
    # pred [broncos, won] vs [denver, broncos]: 0.5; vs [broncos]: P = 1/2, R = 1 -> 2/3;
    # vs [broncos, team]: 0.5. The max is 2/3.
    assert squad_f1("Broncos won", gold) == pytest.approx(2 / 3)
    assert squad_em("broncos", gold) == 1.0
    assert squad_em("Broncos won", gold) == 0.0
    assert squad_f1("", gold) == 0.0
    with pytest.raises(ValueError, match="non-empty sequence"):
        squad_f1("x", ())
    with pytest.raises(ValueError, match="non-empty sequence"):
        squad_em("x", "Broncos")  # a bare string would be scored character by character


# --- prompt and answer extraction -------------------------------------------------------------


def test_squad_prompt_and_answer_text():
    ex = SquadExample("q1", "Super Bowl 50", "The game was played in Santa Clara.",
                      " Where was the game played? ", ("Santa Clara",))
    assert squad_prompt(ex) == ("Title: Super Bowl 50\nContext: The game was played in Santa "
                                "Clara.\nQuestion: Where was the game played?\nAnswer:")
    assert answer_text(" Santa Clara\nQuestion: next one") == "Santa Clara"
    assert answer_text("  Levi's Stadium  ") == "Levi's Stadium"
    assert answer_text("\nSanta Clara") == ""


# --- loading ----------------------------------------------------------------------------------


def _write_squad(path, articles):
    path.write_text(json.dumps({"version": "1.1", "data": articles}))


def test_load_small_file_and_subsample(tmp_path):
    articles = [
        {"title": "Super_Bowl_50", "paragraphs": [
            {"context": "c0", "qas": [
                {"id": "a", "question": "q a", "answers": [{"text": "x", "answer_start": 0},
                                                           {"text": "y", "answer_start": 0}]},
                {"id": "b", "question": "q b", "answers": [{"text": "z", "answer_start": 0}]}]},
            {"context": "c1", "qas": [
                {"id": "c", "question": "q c", "answers": [{"text": "w", "answer_start": 0}]}]},
        ]},
        {"title": "Warsaw", "paragraphs": [{"context": "c2", "qas": [
            {"id": f"d{i}", "question": "q", "answers": [{"text": "v", "answer_start": 0}]}
            for i in range(5)]}]},
    ]
    path = tmp_path / "squad.json"
    _write_squad(path, articles)
    every = load_squad(path=path)
    assert [e.id for e in every] == ["a", "b", "c", "d0", "d1", "d2", "d3", "d4"]
    assert every[0] == SquadExample("a", "Super Bowl 50", "c0", "q a", ("x", "y"))
    assert every[2].context == "c1" and every[3].title == "Warsaw"
    some = load_squad(path=path, max_examples=5, seed=3)
    assert len({e.id for e in some}) == 5
    assert load_squad(path=path, max_examples=3, seed=3) == some[:3]       # prefix property
    assert load_squad(path=path, max_examples=5, seed=3) == some            # deterministic
    draws = {tuple(e.id for e in load_squad(path=path, max_examples=5, seed=s)) for s in range(6)}
    assert len(draws) > 1                                                    # seed matters
    assert load_squad(path=path, max_examples=0) == []
    with pytest.raises(ValueError, match="exceeds the 8 questions"):
        load_squad(path=path, max_examples=9)
    with pytest.raises(ValueError, match="non-negative int"):
        load_squad(path=path, max_examples=-1)


def test_load_rejects_malformed_files(tmp_path):
    path = tmp_path / "bad.json"
    _write_squad(path, [{"title": "T", "paragraphs": [{"context": "c", "qas": [{"id": "x"}]}]}])
    with pytest.raises(ValueError, match="not SQuAD v1.1 JSON"):
        load_squad(path=path)
    _write_squad(path, [{"title": "T", "paragraphs": [{"context": "c", "qas": [
        {"id": "y", "question": "q", "answers": []}]}]}])
    with pytest.raises(ValueError, match="question y has no gold answer"):
        load_squad(path=path)


def test_missing_asset_names_the_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PAVEJAX_CACHE", str(tmp_path))
    with pytest.raises(AssetMissingError, match="pavejax assets --with squad"):
        load_squad()


@pytest.mark.assets
def test_real_squad_dev_set():
    try:
        path = require("squad") / "squaddev_v1.1.json"
    except AssetMissingError:
        pytest.skip("optional asset squad is not installed (pavejax assets --with squad)")
    raw = json.loads(path.read_text(encoding="utf-8"))
    qas = [(a["title"], p["context"], q) for a in raw["data"] for p in a["paragraphs"]
           for q in p["qas"]]
    every = load_squad()
    assert len(every) == len(qas) == 10_565
    assert len({e.id for e in every}) == len(every)
    assert all(e.answers and "_" not in e.title for e in every)
    first = every[0]
    assert (first.title, first.answers[0]) == ("Super Bowl 50", "Denver Broncos")
    assert first.question == "Which NFL team represented the AFC at Super Bowl 50?"
    # Gold answers are spans of their context (answer_start indexes into it).
    title, context, q = qas[1234]
    a = q["answers"][0]
    assert context[a["answer_start"]:a["answer_start"] + len(a["text"])] == a["text"]
    assert every[1234].answers[0] == a["text"] and every[1234].context == context
    # Gold answers score perfectly against themselves.
    assert all(squad_f1(e.answers[0], e.answers) == 1.0 for e in every[:200])
    sub = load_squad(max_examples=100, seed=1)
    assert len(sub) == 100 and sub[:10] == load_squad(max_examples=10, seed=1)
